"""`prl samples RUN`: what the model wrote, read from `RUN_DIR/samples/steps.jsonl` (written by the
orchestrator, `prl.orchestrator.samples`) and printed readably or as JSON lines."""

from __future__ import annotations

import json
from pathlib import Path

from prl.orchestrator.samples import STEPS_FILE


class SamplesError(ValueError):
    """A run without samples, or a step it has none of, in one line."""


def read_samples(run_dir: Path, eval_set: str | None = None) -> list[dict]:
    """The run's kept samples of its RL steps, or (`eval_set`) every completion that eval set scored."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SamplesError(f"{run_dir}: no such directory (give a run directory, e.g. runs/reverse-tiny)")
    path = run_dir / "samples" / (STEPS_FILE if eval_set is None else f"eval_{eval_set}.jsonl")
    if not path.is_file():
        if not (run_dir / "metrics.jsonl").is_file():
            raise SamplesError(f"{run_dir}: not a prl run directory (no metrics.jsonl; `prl runs` lists the runs)")
        if eval_set is not None:
            sets = sorted(p.stem.removeprefix("eval_") for p in (run_dir / "samples").glob("eval_*.jsonl"))
            raise SamplesError(f"--eval {eval_set}: the run has no completions of that set (sets: "
                               f"{', '.join(sets) or 'none yet'})")
        raise SamplesError(f"{run_dir}: no samples written yet ({path} is missing; a run writes "
                           f"run.samples_per_step samples a step)")
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a killed orchestrator
    return out


def select(samples: list[dict], step: str, order: str | None, grep: str | None) -> list[dict]:
    """The samples of `step` ("latest", "all" or a number), those holding `grep`, sorted by reward (`order`: "best"
    first or "worst" first; None: as written)."""
    if not samples:
        raise SamplesError("no samples written yet")
    steps = sorted({s["step"] for s in samples})
    if step == "latest":
        want = {steps[-1]}
    elif step == "all":
        want = set(steps)
    else:
        if not step.isdigit() or int(step) not in steps:
            raise SamplesError(f"--step {step}: the run has samples of steps {steps[0]}..{steps[-1]} (or 'latest', "
                               f"'all')")
        want = {int(step)}
    out = [s for s in samples if s["step"] in want]
    if grep:
        out = [s for s in out if grep in s["prompt"] or grep in s["completion"]]
    if order:
        out.sort(key=lambda s: s["reward"], reverse=order == "best")
    return out


def show(s: dict) -> str:
    """One sample as text: a header line, the prompt, then the completion (multi-turn: each turn marked)."""
    versions = ",".join(map(str, s.get("versions", [])))
    extra = f"  advantage {s['advantage']:+.3f}" if "advantage" in s else ""
    extra += f"  answer {s['answer']!r}" if "answer" in s else ""
    head = (f"step {s['step']}  example {s['prompt_index']}  reward {s['reward']:.3f}{extra}  version {versions}  "
            f"{s.get('tokens', '?')} tokens")
    body = [head, "  prompt:     " + indent(s["prompt"])]
    if s.get("turns"):
        for t in s["turns"]:
            body.append(("  model:      " if t["role"] == "model" else "  env:        ") + indent(t["text"]))
    else:
        body.append("  completion: " + indent(s["completion"]))
    if s.get("info"):
        body.append("  info:       " + json.dumps(s["info"], default=str))
    return "\n".join(body)


def indent(text: str) -> str:
    return text.replace("\n", "\n              ")

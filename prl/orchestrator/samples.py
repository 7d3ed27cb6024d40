"""What the model wrote, kept as text: a bounded sample of every step's rollouts (`run.samples_per_step`: the
step's best and worst by reward, then others drawn by the step's seed) in `RUN_DIR/samples/steps.jsonl`, one
JSON object a sample, and every completion each eval set scores at each of its steps in
`RUN_DIR/samples/eval_NAME.jsonl`, read back by `prl samples` (`prl.launch.samples`).

A sample holds its step, prompt index, prompt and completion as text, the reward and advantage, the weights
versions of its model tokens and the environment's info; a multi-turn completion also holds its turns
(`{"role": "model" | "env", "text"}`, runs of the loss mask), so tool results and program output show apart
from what the model wrote."""

from __future__ import annotations

import json
import random
from pathlib import Path

STEPS_FILE = "steps.jsonl"


def pick(rewards: list[float], n: int, seed: int) -> list[int]:
    """Up to `n` indices of `rewards`: the best, the worst, then others drawn by `seed`, in index order."""
    if n <= 0 or not rewards:
        return []
    order = sorted(range(len(rewards)), key=lambda i: rewards[i])
    chosen = [order[-1], order[0]][:n]
    rest = [i for i in range(len(rewards)) if i not in chosen]
    chosen += random.Random(seed).sample(rest, min(len(rest), n - len(set(chosen))))
    return sorted(set(chosen))


def turns(tokenizer, completion_ids: list[int], mask: list[int] | None) -> list[dict] | None:
    """The completion as runs of the model's tokens and the environment's; None when every token is the model's."""
    if not mask or all(mask):
        return None
    out, start = [], 0
    for end in range(1, len(mask) + 1):
        if end == len(mask) or mask[end] != mask[start]:
            text = tokenizer.decode(completion_ids[start:end], skip_special_tokens=False)
            out.append({"role": "model" if mask[start] else "env", "text": text})
            start = end
    return out


def record(tokenizer, step: int, prompt_index: int, sample, info: dict) -> dict:
    """A trained sample (`Sample`: with its advantage) or an eval set's trajectory (`Trajectory`: with the answer
    maj@k votes on) as text."""
    mask = sample.mask or [1] * len(sample.versions)
    out = {"step": step, "prompt_index": prompt_index,
           "prompt": tokenizer.decode(sample.prompt_ids, skip_special_tokens=False),
           "completion": tokenizer.decode(sample.completion_ids, skip_special_tokens=True),
           "reward": round(float(sample.reward), 6),
           "versions": sorted({v for v, m in zip(sample.versions, mask) if m}), "tokens": len(sample.completion_ids)}
    if hasattr(sample, "advantage"):
        out["advantage"] = round(float(sample.advantage), 6)
    if getattr(sample, "answer", None) is not None:
        out["answer"] = sample.answer
    parts = turns(tokenizer, sample.completion_ids, sample.mask)
    if parts is not None:
        out["turns"] = parts
    if info:
        out["info"] = info
    return out


class SampleWriter:
    """Appends each step's picked samples to `samples/steps.jsonl` (a restarted orchestrator appends after)."""

    def __init__(self, run_dir: Path, per_step: int, seed: int, tokenizer):
        self.path = Path(run_dir) / "samples" / STEPS_FILE
        self.per_step, self.seed, self.tokenizer = per_step, seed, tokenizer

    def write_step(self, step: int, groups) -> None:
        members = [(g.prompt_index, s, g.infos[i] if i < len(g.infos) else {})
                   for g in groups for i, s in enumerate(g.samples)]
        chosen = pick([s.reward for _, s, _ in members], self.per_step, self.seed * 1_000_003 + step)
        if not chosen:
            return
        self.append(self.path, [record(self.tokenizer, step, *members[i]) for i in chosen])

    def write_eval(self, name: str, step: int, indices: list[int], groups: list) -> None:
        """Every completion an eval set scored at `step` (a skipped example's none), to samples/eval_NAME.jsonl."""
        records = [record(self.tokenizer, step, index, t, t.info or {})
                   for index, group in zip(indices, groups) if group is not None for t in group]
        self.append(self.path.parent / f"eval_{name}.jsonl", records)

    @staticmethod
    def append(path: Path, records: list[dict]) -> None:
        if not records:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write("\n".join(json.dumps(r, default=str) for r in records) + "\n")

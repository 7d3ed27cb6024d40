"""Synchronous (max_async_level 0) against asynchronous (max_async_level 2) RL, side by side.

Runs the real `prl run` (inference server, orchestrator, torchrun trainer) twice on the same
recipe with a long-tailed completion-length distribution: no warm start, so the random model
stops at EOS after a geometric number of tokens, capped at `--max-tokens`. The two settings
alternate over `--repeats` rounds so machine noise hits both. Reports steady-state wall time per
step (first steps excluded), trainer idle (waiting for a batch) and inference idle fractions.

    .venv/bin/python bench/async_overlap.py [--steps 12] [--repeats 1] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(level: int, args, out: Path) -> dict:
    name = f"async{level}"
    cmd = [sys.executable, "-m", "prl", "run", str(ROOT / "recipes/reverse-tiny.toml"), "--no-tui", "--force",
           "--set", f"run.output_dir={out}", "--set", f"run.name={name}", "--set", "sft.steps=0",
           "--set", f"rl.max_steps={args.steps}", "--set", f"rl.max_async_level={level}",
           "--set", f"rl.max_off_policy_steps={level}", "--set", f"sampling.max_tokens={args.max_tokens}",
           "--set", "model.max_position_embeddings=512", "--set", "trainer.checkpoint_every=0"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"run failed:\n{p.stdout[-3000:]}")
    events = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return measure(events, args.skip)


def measure(events: list[dict], skip: int) -> dict:
    steps = [e for e in events if e["kind"] == "trainer_step" and e["stage"] == "rl"]
    steady = steps[skip:]
    wall = steady[-1]["t"] - steps[skip - 1]["t"]
    t0 = steps[skip - 1]["t"]
    servers = [e for e in events if e["kind"] == "server" and t0 <= e["t"]]
    busy = (servers[-1]["busy_s"] - servers[0]["busy_s"]) / (servers[-1]["t"] - servers[0]["t"])
    return {
        "s_per_step": wall / len(steady),
        "trainer_idle": sum(e["wait_s"] for e in steady) / wall,
        "inference_idle": 1 - busy,
        "completion_len": sum(e["completion_len"] for e in events if e["kind"] == "orch_step") / len(steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="first steps excluded (start-up)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="prl-bench-"))
    results: dict[int, list[dict]] = {0: [], 2: []}
    for _ in range(args.repeats):
        for level in (0, 2):
            results[level].append(run(level, args, out))
    best = {lvl: min(rs, key=lambda r: r["s_per_step"]) for lvl, rs in results.items()}
    for lvl, r in best.items():
        print(f"max_async_level={lvl}: {r['s_per_step']:.2f} s/step  trainer idle {r['trainer_idle']:.0%}  "
              f"inference idle {r['inference_idle']:.0%}  mean completion {r['completion_len']:.1f} tokens")
    print(f"speed-up async 2 vs sync: {best[0]['s_per_step'] / best[2]['s_per_step']:.2f}x")
    print(json.dumps({"s_per_step_sync": round(best[0]["s_per_step"], 3), "s_per_step_async2": round(best[2]["s_per_step"], 3),
                      "async_over_sync": round(best[0]["s_per_step"] / best[2]["s_per_step"], 3),
                      "trainer_idle_sync": round(best[0]["trainer_idle"], 3),
                      "trainer_idle_async2": round(best[2]["trainer_idle"], 3)}))


if __name__ == "__main__":
    main()

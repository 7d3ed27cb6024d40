"""Distillation against RL at equal steps: does a fresh student learn more from a teacher than from the reward?

    .venv/bin/python bench/distill.py [--teacher-steps 120] [--steps 60] [--mode advantage|loss] [--kl-estimator k2|k3]
                                      [--recipe R] [--out DIR]

1. The teacher: `recipes/reverse-tiny.toml` as shipped (its warm start, then `--teacher-steps` RL steps), exported
   at its last step (`prl ckpt export`).
2. Two students from the same random init, no warm start, `--steps` RL steps each, one after the other on this
   machine: `rl` learns from the task reward; `distill` from the teacher alone (`[teacher]`, kl_coef 1,
   reward_weight 0, `--mode`). Both are scored by the recipe's held-out set (greedy) every 10 steps. `--recipe
   recipes/reverse-tiny-vllm.toml` runs all three on vLLM (the teacher on a vLLM server too).

Prints per student the held-out reward by step and by seconds since its first RL step, the training reward's last
5 steps, and the teacher's own held-out reward; ends with one JSON line: `distill_over_rl` (held-out reward at the
last step, distillation over RL), `distill_over_rl_at_equal_wall` (distillation's latest held-out reward scored
within the seconds RL's whole run took, over RL's last), and each figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "reverse-tiny.toml"


def prl(*args: str) -> None:
    p = subprocess.run([sys.executable, "-m", "prl", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"prl {' '.join(args[:2])} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")


def run(out: Path, name: str, *sets: str, recipe: Path = RECIPE) -> Path:
    keys = [f"run.output_dir={out}", f"run.name={name}", "eval.heldout.every=10", *sets]
    prl("run", str(recipe), "--no-tui", "--force", *(x for s in keys for x in ("--set", s)))
    return out / name


def events(run_dir: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == kind]


def figures(run_dir: Path) -> dict:
    """Held-out reward by step and by seconds since the first RL step; the last 5 steps' training reward."""
    steps = sorted(events(run_dir, "orch_step"), key=lambda e: e["step"])
    start = steps[0]["t"]
    held = [e for e in events(run_dir, "eval") if e["set"] == "heldout"]
    return {"heldout_by_step": {e["step"]: round(e["reward"], 4) for e in held},
            "heldout_by_s": {round(max(0.0, e["t"] - start), 1): round(e["reward"], 4) for e in held},
            "train_reward_last5": round(sum(e["reward"] for e in steps[-5:]) / 5, 4),
            "rl_s": round(steps[-1]["t"] - start, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher-steps", type=int, default=120)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--mode", choices=("advantage", "loss"), default="advantage", help="teacher.mode of the student")
    ap.add_argument("--kl-estimator", choices=("k2", "k3"), default="k2", help="teacher.kl_estimator (mode loss)")
    ap.add_argument("--recipe", type=Path, default=RECIPE, help="recipes/reverse-tiny-vllm.toml: every run on vLLM")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="prl-distill-"))
    teacher_run = run(out, "teacher", f"rl.max_steps={args.teacher_steps}", recipe=args.recipe)
    folder = out / "teacher-hf"
    prl("ckpt", "export", str(teacher_run), "--step", "latest", "--out", str(folder))
    student = ["sft.steps=0", f"rl.max_steps={args.steps}"]
    rl = figures(run(out, "rl", *student, recipe=args.recipe))
    taught = (f'teacher={{path = "{folder}", kl_coef = 1.0, reward_weight = 0.0, mode = "{args.mode}", '
              f'kl_estimator = "{args.kl_estimator}"}}')
    distill = figures(run(out, "distill", *student, taught, recipe=args.recipe))
    teacher_held = max(events(teacher_run, "eval"), key=lambda e: e["step"])["reward"]
    last = max(rl["heldout_by_step"])
    within = [r for s, r in distill["heldout_by_s"].items() if s <= rl["rl_s"]]
    for name, f in (("rl", rl), ("distill", distill)):
        print(f"{name}: held-out reward by step {f['heldout_by_step']}, by seconds {f['heldout_by_s']}, training "
              f"reward (last 5 steps) {f['train_reward_last5']}, {f['rl_s']} s of RL")
    print(f"teacher: held-out reward {teacher_held:.4f} after {args.teacher_steps} RL steps")
    result = {"mode": args.mode, "kl_estimator": args.kl_estimator, "recipe": args.recipe.name,
              "distill_over_rl": round(distill["heldout_by_step"][last] / max(rl["heldout_by_step"][last], 1e-9), 3),
              "distill_over_rl_at_equal_wall": round(within[-1] / max(rl["heldout_by_step"][last], 1e-9), 3),
              "teacher_heldout": round(teacher_held, 4), "steps": args.steps, "rl": rl, "distill": distill}
    print(json.dumps(result))


if __name__ == "__main__":
    main()

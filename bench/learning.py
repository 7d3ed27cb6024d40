"""Does a recipe learn? The real `prl run` of each recipe given, one after the other, and its reward.

    .venv/bin/python bench/learning.py recipes/reverse-tiny.toml [recipes/reverse-tiny-vllm.toml ...]
        [--set KEY=VALUE ...]

For each recipe: mean reward of the first and last 5 RL steps, the improvement, the wall time of the
whole `prl run` (start-up included), and the mean reward per 10 RL steps, read from the run's own
summary.json and metrics.jsonl, and each eval set's pass@1 at every step it scored. Ends with one JSON line of
the figures, keyed by recipe name.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rewards_per_step(run_dir: Path) -> list[float]:
    from prl.tui.state import RunState

    return RunState().update_from(run_dir / "metrics.jsonl").reward_curve()


def per_10(rows: list[dict], key: str) -> list[float]:
    vals = [r.get(key) for r in rows]
    out = []
    for i in range(0, len(vals), 10):
        got = [v for v in vals[i:i + 10] if v is not None]
        out.append(round(sum(got) / len(got), 3) if got else None)
    return out


def env_figures(run_dir: Path) -> dict:
    """Agentic recipes: the RL phase's own time, the code environment's success rates and the tool
    environment's calls and turns per 10 steps."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("kind") == "orch_step"]
    out = {"rl_s": round(steps[-1]["t"] - steps[0]["t"], 1)} if len(steps) > 1 else {}
    if any("first_attempt_success" in r for r in steps):
        out["first_attempt_per_10"] = per_10(steps, "first_attempt_success")
        out["second_turn_per_10"] = per_10(steps, "second_turn_success")
    if any(r.get("env_tool_calls_per_turn") for r in steps):
        out["tool_calls_per_turn_per_10"] = per_10(steps, "env_tool_calls_per_turn")
        out["turns_mean_per_10"] = per_10(steps, "env_turns_mean")  # tool-tiny: 1 + the share that calls
    return out


def eval_figures(run_dir: Path) -> dict:
    """Each held-out set's pass@1 at every step it scored (`eval` events), e.g. {"test": {"0": 0.15, "200": 0.2}}."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out: dict[str, dict] = {}
    for r in rows:
        if r.get("kind") == "eval" and "pass@1" in r:
            out.setdefault(r["set"], {})[str(r["step"])] = r["pass@1"]
    return {"eval_pass1": out} if out else {}


def one(recipe: str, overrides: list[str], out: Path) -> dict:
    name = Path(recipe).stem
    cmd = [str(ROOT / "bin" / "prl"), "run", recipe, "--no-tui", "--set", f"run.output_dir={out}",
           "--set", f"run.name={name}"]
    for item in overrides:
        cmd += ["--set", item]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{recipe}: prl run exited {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    run_dir = out / name  # run.name above
    summary = json.loads((run_dir / "summary.json").read_text())
    per_step = rewards_per_step(run_dir)
    tens = [round(sum(per_step[i:i + 10]) / len(per_step[i:i + 10]), 3) for i in range(0, len(per_step), 10)]
    return {"first5": round(summary["first5_reward"], 3), "last5": round(summary["last5_reward"], 3),
            "improvement": round(summary["improvement"], 3), "rl_steps": summary["rl_steps"],
            "wall_s": summary["wall_s"], "per_10_steps": tens, **env_figures(run_dir), **eval_figures(run_dir)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="KEY=VALUE for every recipe")
    args = ap.parse_args()
    report = {}
    with tempfile.TemporaryDirectory(prefix="prl-learning-") as tmp:
        for recipe in args.recipes:
            r = report[Path(recipe).stem] = one(recipe, args.overrides, Path(tmp))
            print(f"{recipe}: first 5 RL steps {r['first5']:.3f}, last 5 {r['last5']:.3f} "
                  f"({r['improvement']:+.3f}) over {r['rl_steps']} steps, {r['wall_s']:.0f} s; "
                  f"per 10 steps {' '.join(f'{x:.2f}' for x in r['per_10_steps'])}"
                  + "".join(f"; {k} {r[k]}" for k in ("rl_s", "first_attempt_per_10", "second_turn_per_10",
                                                      "tool_calls_per_turn_per_10", "eval_pass1") if k in r),
                  flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

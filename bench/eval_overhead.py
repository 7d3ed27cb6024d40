"""What in-run evaluation costs training: `prl run` of the shipped recipe (recipes/reverse-tiny.toml) with an
eval set scored every 10 steps, against the same recipe with no eval set, alternating in one invocation.

    .venv/bin/python bench/eval_overhead.py [--steps 60] [--pairs 1] [--sft-steps 20] [--examples 64] [--samples 1]
        [--keep DIR [--reuse]]

Both runs are written from one loaded recipe (`prl.recipe.reference.recipe_toml`) into a temporary folder, the
one without `[eval.*]` tables, the other with a single set `[eval.heldout]` of `--examples` x `--samples`
completions (greedy at one sample) every `--every` steps; its samples may be at most 5% of those trained between
two of its points (rl.batch_size x every). Training samples/s: rl.batch_size x the RL steps between the first and
the last RL `trainer_step` event, over the seconds between them (no process start, warm start, step-0 start-up or
final eval). The machine's load moves samples/s between runs, so each run is also measured against itself: the
seconds the steps p .. p + 4 of each eval point p took beyond the run's median step elsewhere, and the ratio of its
samples/s without them to its samples/s (`in_run_ratio`; a run without evals, measured at the same steps, is the
control: its steps there carry what every run pays there, e.g. the step-40 checkpoint; `in_run_over_control` is
the one ratio over the other). Per eval set point: its seconds (the `eval` event's `wall_s`) and `later_share`.

Per run: exit code, RL steps, samples/s, the trainer's mean wait for a batch, `error` and `restart` events. Ends
with one JSON line of the figures (means over the pairs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prl.recipe.load import load_recipe  # noqa: E402
from prl.recipe.reference import recipe_toml  # noqa: E402
from prl.recipe.schema import EvalCfg  # noqa: E402

RECIPE = ROOT / "recipes" / "reverse-tiny.toml"
SHARE = 0.05  # the eval set's samples at most this share of the samples trained between two of its points
WINDOW = 5  # steps from an eval point on that its cost lands in (the set runs over a few steps)


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def write_recipes(args, tmp: Path) -> tuple[dict[str, Path], int, list[int]]:
    """The two recipes, the same but for their eval tables; rl.batch_size; the eval points inside the RL steps."""
    base = load_recipe(RECIPE, [f"rl.max_steps={args.steps}", f"sft.steps={args.sft_steps}"])
    per_point = base.rl.batch_size * args.every
    if args.examples * args.samples > SHARE * per_point:
        raise SystemExit(f"--examples {args.examples} x --samples {args.samples} = {args.examples * args.samples} eval "
                         f"samples: more than {SHARE:.0%} of the {per_point} trained between two points")
    ev = EvalCfg(examples=args.examples, samples=args.samples, every=args.every,
                 temperature=0.0 if args.samples == 1 else 1.0)
    paths = {}
    for name, evals in (("with_eval", {"heldout": ev}), ("without_eval", {})):
        paths[name] = tmp / f"{name}.toml"
        paths[name].write_text(recipe_toml(base.model_copy(update={"eval": evals})))
        back = load_recipe(paths[name])  # what the run reads is the recipe meant
        if back.eval.keys() != evals.keys() or back.model_copy(update={"eval": {}}) != base.model_copy(update={"eval": {}}):
            raise SystemExit(f"{paths[name]}: does not read back as the recipe written")
    return paths, base.rl.batch_size, [p for p in ev.points(args.steps) if 0 < p < args.steps]


def one(name: str, recipe: Path, out: Path, batch_size: int, points: list[int], reuse: bool) -> dict:
    if reuse:  # a kept run measured again: its exit from the run's last `run` event
        state = [e.get("state") for e in events(out / name) if e["kind"] == "run"]
        return {"rc": 0 if state[-1:] == ["finished"] else 1, **measure(out / name, batch_size, points)}
    t0 = time.time()
    cmd = [str(ROOT / "bin" / "prl"), "run", str(recipe), "--no-tui", "--force", "--set", f"run.output_dir={out}",
           "--set", f"run.name={name}"]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    fig = {"rc": proc.returncode, "wall_s": round(time.time() - t0, 1)}
    if proc.returncode:
        fig["log_tail"] = proc.stdout[-2000:]
    return {**fig, **measure(out / name, batch_size, points)}


def measure(run_dir: Path, batch_size: int, points: list[int]) -> dict:
    evs = events(run_dir)
    steps = [e for e in evs if e["kind"] == "trainer_step" and e.get("stage") == "rl"]
    fig = {"rl_steps": len(steps),
           "errors": [f"{e.get('name')}: {e.get('line', '')[:160]}" for e in evs if e["kind"] == "error"],
           "restarts": [f"{e.get('name')}: {str(e.get('cause', ''))[:160]}" for e in evs if e["kind"] == "restart"]}
    if len(steps) < 2:
        return fig
    first, last = steps[0]["t"], steps[-1]["t"]
    rl_s = last - first
    fig.update(rl_s=round(rl_s, 2), samples_per_s=round(batch_size * (len(steps) - 1) / rl_s, 2),
               trainer_wait_s_mean=round(statistics.mean(e.get("wait_s", 0.0) for e in steps[1:]), 3))
    # Within the run: the seconds steps p .. p + WINDOW - 1 of each eval point p took beyond the run's median step
    # elsewhere (a run without evals, measured at the same steps, is the control)
    took = {b["step"]: b["t"] - a["t"] for a, b in zip(steps, steps[1:])}
    near = {s for p in points for s in range(p, p + WINDOW) if s in took}
    pace = statistics.median(d for s, d in took.items() if s not in near)
    excess = sum(took[s] - pace for s in near)
    fig.update(median_step_s=round(pace, 3), excess_s_near_evals=round(excess, 2),
               in_run_ratio=round((rl_s - excess) / rl_s, 3))
    ev = [e for e in evs if e["kind"] == "eval"]
    if ev:
        fig.update(evals_logged=len(ev), evals_in_window=sum(1 for e in ev if first <= e["started"] <= last),
                   eval_points=[e["step"] for e in ev],
                   eval_wall_s=[round(e.get("wall_s", e["t"] - e["started"]), 2) for e in ev],
                   later_share=[e.get("later_share") for e in ev],
                   pass1=[e.get("pass@1") for e in ev])
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="rl.max_steps of each run")
    ap.add_argument("--pairs", type=int, default=1, help="runs of each kind, alternating")
    ap.add_argument("--sft-steps", type=int, default=20, help="sft.steps of each run (the warm start)")
    ap.add_argument("--examples", type=int, default=64, help="the eval set's examples")
    ap.add_argument("--samples", type=int, default=1, help="completions per example (sampled at temperature 1 if > 1)")
    ap.add_argument("--every", type=int, default=10, help="the eval set's every")
    ap.add_argument("--keep", type=Path, help="write the recipes and runs under this folder and keep them")
    ap.add_argument("--reuse", action="store_true", help="measure the runs kept under --keep again, running none")
    args = ap.parse_args()
    if args.reuse and not args.keep:
        ap.error("--reuse measures the runs of --keep DIR")
    runs: dict[str, list[dict]] = {"with_eval": [], "without_eval": []}
    failed = []
    with tempfile.TemporaryDirectory(prefix="prl-eval-overhead-") as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        recipes, batch_size, points = write_recipes(args, Path(tmp))
        for i in range(args.pairs):
            for kind in (("with_eval", "without_eval") if i % 2 == 0 else ("without_eval", "with_eval")):
                fig = one(f"{kind}-{i}", recipes[kind], Path(tmp) / "runs", batch_size, points, args.reuse)
                bad = fig["rc"] != 0 or fig["rl_steps"] != args.steps or "samples_per_s" not in fig
                if bad:
                    failed.append(f"{kind}-{i}: exit {fig['rc']} after {fig['rl_steps']} of {args.steps} steps")
                print(f"{kind}-{i}: {json.dumps({k: v for k, v in fig.items() if k != 'log_tail'})}"
                      + (f"\n{fig.get('log_tail', '')}" if bad else ""), file=sys.stderr, flush=True)
                runs[kind].append(fig)
    if failed:
        print(json.dumps({"failed": failed}))
        sys.exit(1)
    mean = lambda xs: round(statistics.mean(xs), 3) if xs else None  # noqa: E731
    w = mean([r["samples_per_s"] for r in runs["with_eval"]])
    wo = mean([r["samples_per_s"] for r in runs["without_eval"]])
    walls = [s for r in runs["with_eval"] for p, s in zip(r["eval_points"], r["eval_wall_s"]) if 0 < p < args.steps]
    shares = [x for r in runs["with_eval"] for p, x in zip(r["eval_points"], r["later_share"])
              if 0 < p < args.steps and x is not None]
    print(json.dumps({
        "steps": args.steps, "pairs": args.pairs, "eval_samples": args.examples * args.samples,
        "with_eval_samples_per_s": w, "without_eval_samples_per_s": wo, "with_eval_over_without": round(w / wo, 3),
        "with_eval_over_without_in_run": mean([r["in_run_ratio"] for r in runs["with_eval"]]),
        "without_eval_in_run_control": mean([r["in_run_ratio"] for r in runs["without_eval"]]),
        "in_run_over_control": round(statistics.mean(r["in_run_ratio"] for r in runs["with_eval"])
                                     / statistics.mean(r["in_run_ratio"] for r in runs["without_eval"]), 3),
        "trainer_wait_s_with_eval": mean([r["trainer_wait_s_mean"] for r in runs["with_eval"]]),
        "trainer_wait_s_without_eval": mean([r["trainer_wait_s_mean"] for r in runs["without_eval"]]),
        "eval_wall_s_mean": mean(walls), "evals_logged": sum(r.get("evals_logged", 0) for r in runs["with_eval"]),
        "later_share_mean": mean(shares),
        "errors": sum(len(r["errors"]) for rs in runs.values() for r in rs),
        "restarts": sum(len(r["restarts"]) for rs in runs.values() for r in rs),
    }))


if __name__ == "__main__":
    main()

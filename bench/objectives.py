"""RL objectives side by side: the real `prl run` of the same recipe with each objective, each given the same
wall time of RL on the same machine, in one invocation.

    .venv/bin/python bench/objectives.py [--seeds 3] [--rl-seconds 90] [--code-seconds 120] [--code-sft-steps N]
        [--only VARIANT ...] [--skip-code] [--keep DIR]

reverse-tiny (recipes/reverse-tiny.toml) with
    clip         trainer.loss.correction = "clip" (the default: PPO's clip against the sampling policy)
    cispo        "cispo"
    gspo         "gspo" (one ratio per sample; trainer.loss.normalize "auto" is "sequence" for it)
    clip_filter  "clip" and rl.filter_groups = "uniform" (online difficulty filtering; skipped, with a note, where
                 this prl has no such key)
    clip_kl      "clip" and trainer.loss.kl_coef = 0.05 (KL to the frozen step-0 policy: its reference forward is
                 inside the trainer's fwd_bwd_s, so clip_kl_over_clip_fwd_bwd_s is what KL costs a step)
`--seeds` runs of each (run.seed 0, 1, ...), interleaved: within a seed every variant runs once, in an order
rotated by the seed, so the machine's load drifting over the bench hits every variant alike.
code-tiny (recipes/code-tiny.toml: two attempts at a minilang program in the sandbox, rl.credit = "turn") with
clip, cispo and gspo, one seed; gspo gives a sample one advantage, so its code-tiny run has rl.credit =
"trajectory" (prl refuses gspo with per-turn credit): its reward there is not the same objective on the same
credit. `--code-sft-steps` shortens code-tiny's warm start (the recipe's 300 SFT steps) where it dominates.
`--only` also takes gspo_token and tis (not run by default).

Every run: `prl run RECIPE --no-tui --set rl.max_steps=2000` (the cosine schedule stays near its peak over the
window), waited on through its own metrics.jsonl until the first RL `trainer_step`; then `--rl-seconds`
(code-tiny: `--code-seconds`) of RL; then SIGINT to the `prl run` process (its clean stop: every process of the
run ends), waited for, and the run's processes checked to be gone. Warm start, start-up and stop are outside
the window. Per run, from its events inside the window: RL steps, steps/s (RL steps after the first over the
window's seconds), the orchestrator's reward (mean of the last 5 `orch_step`s, and that minus the first 5), the
held-out eval's reward at its last point in the window, the trainer's mean fwd_bwd_s (and its median, steadier
when other work shares the cores) and mean wait_s per step (the window's first step, with its start-up, left
out), mean mismatch_kl, entropy and kl_ref (clip_kl), and every `error` and `restart` event (those logged after
the stop was sent are shown apart). On a busy machine steps/s
moves with the load; fwd_bwd_s moves less, and is the figure the objectives are held to (at most 5% over clip).

Prints one line per run (stderr), a table of the means per variant over the seeds, and ends with one JSON line:
per variant `<variant>_<figure>` (code-tiny's prefixed `code_`) and `<variant>_over_clip_<figure>` for
reward_last5, steps_per_s, fwd_bwd_s and fwd_bwd_s_median. `--seeds 0` leaves reverse-tiny out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prl.metrics import read_events  # noqa: E402
from prl.recipe import RecipeError, load_recipe  # noqa: E402

REVERSE = ROOT / "recipes" / "reverse-tiny.toml"
CODE = ROOT / "recipes" / "code-tiny.toml"
MAX_STEPS = 2000  # far more than a window holds: runs end by the bench's stop, never by max_steps
START_TIMEOUT_S = 3600.0  # from `prl run` to its first RL step (warm start included), on a busy machine
STOP_TIMEOUT_S = 300.0
LAST = 5

CORRECTION = lambda name: f'trainer.loss.correction="{name}"'  # noqa: E731
VARIANTS = {
    "clip": [CORRECTION("clip")],
    "cispo": [CORRECTION("cispo")],
    "gspo": [CORRECTION("gspo")],
    "clip_filter": [CORRECTION("clip"), 'rl.filter_groups="uniform"'],
    "clip_kl": [CORRECTION("clip"), "trainer.loss.kl_coef=0.05"],
    "gspo_token": [CORRECTION("gspo_token")],  # the rest: only when --only names them
    "tis": [CORRECTION("tis")],
}
REVERSE_DEFAULT = ["clip", "cispo", "gspo", "clip_filter", "clip_kl"]
CODE_DEFAULT = ["clip", "cispo", "gspo"]
CODE_EXTRA = {"gspo": ['rl.credit="trajectory"']}  # gspo refuses code-tiny's per-turn credit
FIGURES = ("rl_steps", "steps_per_s", "fwd_bwd_s", "fwd_bwd_s_median", "wait_s", "reward_first5", "reward_last5",
           "reward_gain", "heldout_reward", "mismatch_kl", "entropy", "kl_ref")


class Events:
    """A run's metrics.jsonl, read on from where it was last read."""

    def __init__(self, run_dir: Path):
        self.path, self.offset, self.all = run_dir / "metrics.jsonl", 0, []

    def poll(self) -> list[dict]:
        new, self.offset = read_events(self.path, self.offset)
        self.all += new
        return new


def rl_steps_of(evs: list[dict]) -> list[dict]:
    return [e for e in evs if e.get("kind") == "trainer_step" and e.get("stage") == "rl"]


def left_running(evs: list[dict], run_dir: Path) -> list[int]:
    """Pids still alive (not zombies) of the run: in the process groups its driver started, or naming its folder."""
    import psutil

    groups = {e["pid"] for e in evs if e.get("kind") == "process" and e.get("pid")}
    me = os.getpid()
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.pid == me or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if os.getpgid(p.pid) in groups or str(run_dir) in " ".join(p.info["cmdline"] or []):
                found.append(p.pid)
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def end_leftovers(pids: list[int]) -> None:
    """The run's processes still alive after its driver exited (none, normally): SIGTERM, then SIGKILL."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.terminate()
            procs.append(p)
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            continue


def stop(proc: subprocess.Popen) -> float:
    """SIGINT to `prl run` (what Ctrl-C does) and wait for it to exit; the seconds it took."""
    t = time.time()
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the driver's teardown is cut short only by this
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return round(time.time() - t, 1)


def one(recipe: Path, name: str, sets: list[str], seconds: float, out: Path) -> dict:
    """One `prl run` given `seconds` of RL from its first RL step; its figures."""
    run_dir = out / name
    cmd = [sys.executable, "-m", "prl", "run", str(recipe), "--no-tui", "--force", "--set", f"run.output_dir={out}",
           "--set", f"run.name={name}", "--set", f"rl.max_steps={MAX_STEPS}"]
    for s in sets:
        cmd += ["--set", s]
    log_path = out / f"{name}.log"
    started = time.time()
    ev = Events(run_dir)
    t0 = t_end = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                new = ev.poll()
                if t0 is None:
                    first = rl_steps_of(new)
                    if first:
                        t0 = first[0]["t"]
                        t_end = t0 + seconds
                    elif time.time() - started > START_TIMEOUT_S:
                        break
                elif time.time() >= t_end:
                    break
                time.sleep(0.5 if t0 is None else min(0.5, max(0.05, t_end - time.time())))
            stop_sent = time.time()
            stop_s = stop(proc)
        finally:  # the bench itself interrupted: the run stops too
            if proc.poll() is None:
                stop(proc)
    ev.poll()
    leftovers = left_running(ev.all, run_dir)
    if leftovers:
        end_leftovers(leftovers)
    fig = {"rc": proc.returncode, "startup_s": round(t0 - started, 1) if t0 else None, "stop_s": stop_s,
           "left_running": leftovers}
    if t0 is None or t_end is None or stop_sent < t_end - 1:
        fig["failed"] = (f"no RL step after {time.time() - started:.0f} s" if t0 is None
                         else f"exited {proc.returncode} after {stop_sent - t0:.0f} of {seconds:.0f} s of RL")
        fig["log_tail"] = log_path.read_text()[-3000:]
    return {**fig, **measure(ev.all, t0, min(t_end or stop_sent, stop_sent), stop_sent)}


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def measure(evs: list[dict], t0: float | None, t_end: float, stop_sent: float) -> dict:
    errors = [f"{e.get('name')}: {e.get('type', '')} {str(e.get('line', ''))[:200]}" for e in evs
              if e.get("kind") == "error" and e["t"] <= stop_sent]
    stopping = [f"{e.get('name')}: {e.get('type', '')} {str(e.get('line', ''))[:200]}" for e in evs
                if e.get("kind") == "error" and e["t"] > stop_sent]
    restarts = [f"{e.get('name')}: {str(e.get('cause', ''))[:200]}" for e in evs if e.get("kind") == "restart"]
    fig = {"errors": errors, "errors_while_stopping": stopping, "restarts": restarts}
    if t0 is None:
        return fig
    steps = [e for e in rl_steps_of(evs) if e["t"] <= t_end]
    later = [e for e in steps if e["t"] > t0]  # the first step carries the trainer's start-up
    orch = [e for e in evs if e.get("kind") == "orch_step" and e["t"] <= t_end and e.get("reward") is not None]
    held = [e for e in evs if e.get("kind") == "eval" and e.get("set") == "heldout" and e["t"] <= t_end]
    first5, last5 = mean(e["reward"] for e in orch[:LAST]), mean(e["reward"] for e in orch[-LAST:])
    fig.update(
        rl_s=round(t_end - t0, 1), rl_steps=len(steps), steps_per_s=len(later) / max(t_end - t0, 1e-9),
        fwd_bwd_s=mean(e.get("fwd_bwd_s") for e in later),
        fwd_bwd_s_median=statistics.median(e["fwd_bwd_s"] for e in later) if later else None,
        wait_s=mean(e.get("wait_s") for e in later),
        publish_s=mean(e.get("publish_s") for e in later),
        reward_first5=first5, reward_last5=last5,
        reward_gain=last5 - first5 if first5 is not None and last5 is not None else None,
        heldout_reward=held[-1].get("reward") if held else None, heldout_step=held[-1].get("step") if held else None,
        heldout_reward_step0=next((e.get("reward") for e in held if e.get("step") == 0), None),
        mismatch_kl=mean(e.get("mismatch_kl") for e in steps), entropy=mean(e.get("entropy") for e in steps),
        kl_ref=mean(e.get("kl_ref") for e in steps), loss=mean(e.get("loss") for e in steps))
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in fig.items()}


def filtering_known() -> bool:
    try:
        load_recipe(REVERSE, ['rl.filter_groups="uniform"'])
        return True
    except RecipeError:
        return False


def plan(args) -> list[tuple[str, Path, list[str], list[str], float, int]]:
    """(task, recipe, variants, extra sets, seconds, seeds) to run, each variant's recipe checked to load."""
    only = args.only or None
    tasks = [("reverse", REVERSE, REVERSE_DEFAULT, [], args.rl_seconds, args.seeds)] if args.seeds > 0 else []
    if not args.skip_code:
        code_sets = [f"sft.steps={args.code_sft_steps}"] if args.code_sft_steps is not None else []
        tasks.append(("code", CODE, CODE_DEFAULT, code_sets, args.code_seconds, 1))
    out = []
    for task, recipe, default, sets, seconds, seeds in tasks:
        names = [v for v in VARIANTS if v in only] if only else list(default)
        if "clip_filter" in names and not filtering_known():
            print(f"{task}: clip_filter skipped: this prl has no rl.filter_groups", file=sys.stderr, flush=True)
            names.remove("clip_filter")
        for v in names:
            try:
                load_recipe(recipe, variant_sets(task, v, sets))
            except RecipeError as e:
                sets_v = variant_sets(task, v, sets)
                raise SystemExit(f"{task} {v}: the recipe does not load with {sets_v}:\n{e}") from None
        if names:
            out.append((task, recipe, names, sets, seconds, seeds))
    return out


def variant_sets(task: str, variant: str, sets: list[str]) -> list[str]:
    return [*sets, *VARIANTS[variant], *(CODE_EXTRA.get(variant, []) if task == "code" else [])]


def fmt(x, digits=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) >= 10 ** -digits or x == 0 else f"{x:.1e}"
    return str(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3,
                    help="reverse-tiny runs per variant (run.seed 0, 1, ...; 0: leave reverse-tiny out)")
    ap.add_argument("--rl-seconds", type=float, default=90.0, help="seconds of RL per reverse-tiny run")
    ap.add_argument("--code-seconds", type=float, default=120.0, help="seconds of RL per code-tiny run")
    ap.add_argument("--code-sft-steps", type=int, help="code-tiny's sft.steps (the recipe's 300 if not given)")
    ap.add_argument("--only", action="append", choices=list(VARIANTS), help="run only this variant (repeatable)")
    ap.add_argument("--skip-code", action="store_true", help="leave code-tiny out")
    ap.add_argument("--keep", type=Path, help="write the runs under this folder and keep them")
    args = ap.parse_args()
    t_bench = time.time()
    todo = plan(args)
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="prl-objectives-") as scratch:
        out = (args.keep or Path(scratch)).resolve()
        out.mkdir(parents=True, exist_ok=True)
        for task, recipe, names, sets, seconds, seeds in todo:
            for seed in range(seeds):
                order = names[seed % len(names):] + names[:seed % len(names)]
                for v in order:
                    name = f"{task}-{v}-s{seed}"
                    fig = one(recipe, name, [*variant_sets(task, v, sets), f"run.seed={seed}"], seconds, out)
                    results.setdefault((task, v), []).append(fig)
                    shown = {k: x for k, x in fig.items() if k != "log_tail"}
                    print(f"{name}: {json.dumps(shown)}", file=sys.stderr, flush=True)
                    for kind in ("errors", "restarts", "errors_while_stopping"):
                        for line in fig.get(kind, []):
                            print(f"  {name} {kind}: {line}", file=sys.stderr, flush=True)
                    if fig.get("left_running"):
                        print(f"  {name}: processes left running after the stop, ended: {fig['left_running']}",
                              file=sys.stderr, flush=True)
                    if "failed" in fig:
                        print(f"  {name} FAILED: {fig['failed']}\n{fig['log_tail']}", file=sys.stderr, flush=True)
    report: dict = {}
    cols = ("runs", *FIGURES, "errors", "restarts")
    for task, _, names, _, seconds, seeds in todo:
        prefix = "" if task == "reverse" else "code_"
        print(f"\n{task}-tiny: {seeds} seed(s), {seconds:.0f} s of RL per run; means over the seeds")
        rows = [("variant", *cols)]
        for v in names:
            runs = [r for r in results[(task, v)] if "failed" not in r]
            m = {f: mean(r.get(f) for r in runs) for f in FIGURES}
            rows.append((v, str(len(runs)),
                         *(fmt(m[f], 4 if f.startswith(("fwd_bwd_s", "wait_s")) else 3) for f in FIGURES),
                         str(sum(len(r["errors"]) for r in results[(task, v)])),
                         str(sum(len(r["restarts"]) for r in results[(task, v)]))))
            for f in FIGURES:
                if m[f] is not None:
                    report[f"{prefix}{v}_{f}"] = round(m[f], 6)
            report[f"{prefix}{v}_runs_failed"] = len(results[(task, v)]) - len(runs)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        for v in names:
            if v == "clip":
                continue
            for f in ("reward_last5", "steps_per_s", "fwd_bwd_s", "fwd_bwd_s_median"):
                a, b = report.get(f"{prefix}{v}_{f}"), report.get(f"{prefix}clip_{f}")
                if a is not None and b:
                    report[f"{prefix}{v}_over_clip_{f}"] = round(a / b, 3)
        ratios = {k: x for k, x in report.items() if k.startswith(prefix) and "_over_clip_" in k
                  and (prefix or not k.startswith("code_"))}
        if ratios:
            print("  " + ", ".join(f"{k} {x}" for k, x in ratios.items()))
    report.update(seeds=args.seeds, rl_seconds=args.rl_seconds,
                  code_seconds=None if args.skip_code else args.code_seconds,
                  errors=sum(len(r["errors"]) for rs in results.values() for r in rs),
                  restarts=sum(len(r["restarts"]) for rs in results.values() for r in rs),
                  failed=sum("failed" in r for rs in results.values() for r in rs),
                  bench_wall_s=round(time.time() - t_bench), load_avg_1m=round(os.getloadavg()[0], 2))
    print(json.dumps(report))


if __name__ == "__main__":
    main()

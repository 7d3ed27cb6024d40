"""Every weight path on every backend, as a user runs it: `prl run` of the shipped recipe on the embedded
engine (recipes/reverse-tiny.toml) and on vLLM (recipes/reverse-tiny-vllm.toml), with
`trainer.weight_transfer` folder, collective and stream and `rl.max_async_level` 1 and 3; then, per
backend and streaming path, a run whose server is SIGKILLed once RL has begun (it must be restarted
and rejoin on the served version, then follow the trainer's versions over the same path).

    .venv/bin/python bench/weight_paths.py [--steps 40] [--only embedded|vllm] [--no-kill | --kill-only]

Per run: exit code, RL steps, restarts (only the killed runs may have one: the kill's), `unresponsive`
reports (none anywhere), versions a server skipped because it held a newer one (`weights_skipped`),
the reward's first and last 5 steps, wall seconds. A run that fails the rule is named in `failed`. Ends
with one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {"embedded": ROOT / "recipes" / "reverse-tiny.toml", "vllm": ROOT / "recipes" / "reverse-tiny-vllm.toml"}
PATHS = ("folder", "collective", "stream")


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def start(backend: str, path: str, async_level: int, steps: int, out: Path, kill: bool) -> tuple[subprocess.Popen, Path]:
    name = f"{backend}-{path}-a{async_level}" + ("-killed" if kill else "")
    cmd = [str(ROOT / "bin" / "prl"), "run", str(RECIPES[backend]), "--no-tui", "--set", f"run.output_dir={out}",
           "--set", f"run.name={name}", "--set", f'trainer.weight_transfer="{path}"',
           "--set", f"rl.max_async_level={async_level}", "--set", f"rl.max_steps={steps}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return proc, out / name


def kill_server_once_rl_began(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL inference-0 (its process group) once two RL steps were trained."""
    while proc.poll() is None:
        evs = events(run_dir)
        if sum(1 for e in evs if e["kind"] == "orch_step") >= 2:
            server = [e for e in evs if e["kind"] == "process" and e.get("name") == "inference-0" and e.get("pid")][-1]
            try:
                os.killpg(server["pid"], signal.SIGKILL)
            except ProcessLookupError:  # it exited meanwhile: the run reports that itself
                pass
            return
        time.sleep(0.5)


def figures(proc: subprocess.Popen, run_dir: Path, wall_s: float, killed: bool) -> dict:
    evs = events(run_dir)
    rewards = [e["reward"] for e in evs if e["kind"] == "orch_step"]
    restarts = [e.get("cause", "") for e in evs if e["kind"] == "restart"]
    rejoined = [e for e in evs if e["kind"] == "server_state" and e.get("state") == "up"]
    out = {
        "rc": proc.returncode, "rl_steps": len(rewards), "restarts": len(restarts), "restart_causes": restarts[:3],
        "unresponsive": sum(1 for e in evs if e["kind"] == "unresponsive"),
        "weights_skipped": sum(1 for e in evs if e["kind"] == "weights_skipped"),
        "first5": round(sum(rewards[:5]) / 5, 3) if len(rewards) >= 5 else None,
        "last5": round(sum(rewards[-5:]) / 5, 3) if len(rewards) >= 5 else None, "wall_s": round(wall_s, 1),
    }
    if killed:
        served = [e["version"] for e in evs if e["kind"] == "server" and e.get("name") == "inference-0"]
        out["rejoined_version"] = rejoined[-1].get("version") if rejoined else None
        out["final_version"] = served[-1] if served else None
    return out


def verdict(fig: dict, steps: int, killed: bool) -> str | None:
    """Why a run breaks the rule, None when it keeps it."""
    if fig["rc"] != 0 or fig["rl_steps"] != steps:
        return f"exit {fig['rc']} after {fig['rl_steps']} of {steps} steps"
    if fig["unresponsive"]:
        return f"{fig['unresponsive']} unresponsive reports"
    if fig["restarts"] != (1 if killed else 0):
        return f"{fig['restarts']} restarts: {fig['restart_causes']}"
    if killed and (fig.get("rejoined_version") is None or (fig.get("final_version") or 0) < steps - 2):
        return f"the killed server did not rejoin and follow the trainer (final version {fig.get('final_version')})"
    return None


def one(backend: str, path: str, async_level: int, steps: int, out: Path, kill: bool) -> dict:
    t0 = time.time()
    proc, run_dir = start(backend, path, async_level, steps, out, kill)
    if kill:
        kill_server_once_rl_began(proc, run_dir)
    log, _ = proc.communicate()
    fig = figures(proc, run_dir, time.time() - t0, kill)
    if fig["rc"] != 0:
        fig["log_tail"] = log[-1500:]
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--only", choices=sorted(RECIPES))
    ap.add_argument("--no-kill", action="store_true", help="leave out the runs whose server is killed")
    ap.add_argument("--kill-only", action="store_true", help="only the runs whose server is killed")
    args = ap.parse_args()
    backends = [args.only] if args.only else list(RECIPES)
    runs = [] if args.kill_only else [(b, p, a, False) for b in backends for p in PATHS for a in (1, 3)]
    if not args.no_kill:
        runs += [(b, p, 1, True) for b in backends for p in ("collective", "stream")]
    results, failed = {}, []
    with tempfile.TemporaryDirectory(prefix="prl-weight-paths-") as tmp:
        for backend, path, level, kill in runs:
            key = f"{backend}/{path}/async{level}" + ("/killed" if kill else "")
            fig = one(backend, path, level, args.steps, Path(tmp), kill)
            why = verdict(fig, args.steps, kill)
            if why:
                failed.append(f"{key}: {why}")
            print(f"{key}: {json.dumps({k: v for k, v in fig.items() if k != 'log_tail'})}"
                  + (f"  FAILED: {why}\n{fig.get('log_tail', '')}" if why else ""), file=sys.stderr, flush=True)
            results[key] = {k: v for k, v in fig.items() if k not in ("log_tail", "restart_causes")}
    print(json.dumps({"steps": args.steps, "runs": len(results), "failed": failed,
                      "weights_skipped_total": sum(r["weights_skipped"] for r in results.values()),
                      "results": results}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

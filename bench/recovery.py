"""Recovery from faults, measured in real runs: for each fault, the seconds from the fault to the run
training a new step again, and the run's steps per minute against a run without a fault.

Runs `prl run recipes/reverse-tiny.toml` (one inference server, so a server fault stops generation
until the restart) once without a fault and once per fault; each fault is injected after RL step
`--at` of its run. Reported per fault: `restart_s`, from the signal to the driver's restart of the
process (a hang is only seen after `--hang-timeout`); `back_s`, from the signal to the first new RL
step completed after the repair (the server rejoined, the trainer restarted and replayed: a replayed
step does not count); `first_step_s`, from the signal to the first new RL step at all (buffered
rollouts may keep the trainer busy through a server fault). Steps/min are over the whole RL phase.

    .venv/bin/python bench/recovery.py [--steps 24] [--at 8] [--hang-timeout 10] [--faults all]

The last line is a JSON object: {fault: {restart_s, back_s, first_step_s, steps_per_min, ratio_to_no_fault}}.
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


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
FAULTS = {  # name -> (process whose pid is signalled, signal)
    "server SIGKILL": ("inference-0", signal.SIGKILL),
    "server SIGSTOP": ("inference-0", signal.SIGSTOP),
    "trainer SIGKILL": ("trainer-rank", signal.SIGKILL),
    "trainer SIGSTOP": ("trainer-rank", signal.SIGSTOP),
    "orchestrator SIGKILL": ("orchestrator", signal.SIGKILL),
    "orchestrator SIGSTOP": ("orchestrator", signal.SIGSTOP),
}


def read_events(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def rl_steps(evs: list[dict]) -> list[dict]:
    return [e for e in evs if e["kind"] == "trainer_step" and e.get("stage") == "rl"]


def target_pid(evs: list[dict], name: str) -> int:
    lookup = "trainer" if name == "trainer-rank" else name
    pid = [e for e in evs if e["kind"] == "process" and e["name"] == lookup and e.get("pid")][-1]["pid"]
    if name != "trainer-rank":
        return pid
    from test_faults import rank_of_trainer

    return rank_of_trainer(pid)


def one_run(out: Path, name: str, args, fault: tuple[str, signal.Signals] | None) -> dict:
    run_dir = out / name
    cmd = [sys.executable, "-m", "prl", "run", str(ROOT / "recipes/reverse-tiny.toml"), "--no-tui", "--force",
           "--set", f"run.output_dir={out}", "--set", f"run.name={name}", "--set", f"sft.steps={args.sft}",
           "--set", f"rl.max_steps={args.steps}", "--set", "trainer.checkpoint_every=4",
           "--set", f"run.hang_timeout_s={args.hang_timeout}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    fault_t = done_before = None
    if fault:
        while not any(e["step"] >= args.at for e in rl_steps(read_events(run_dir))):
            if proc.poll() is not None:
                raise SystemExit(f"{name}: run ended before the fault:\n{proc.stdout.read()[-3000:]}")
            time.sleep(0.1)
        evs = read_events(run_dir)
        done_before = max(e["step"] for e in rl_steps(evs))
        fault_t = time.time()
        os.kill(target_pid(evs, fault[0]), fault[1])
    output, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{name}: run failed:\n{output[-3000:]}")
    evs = read_events(run_dir)
    steps = rl_steps(evs)
    result = {"steps_per_min": round(60 * (args.steps - 1) / (steps[-1]["t"] - steps[0]["t"]), 1)}
    if fault:
        result.update(timings(evs, steps, fault[0], fault_t, done_before))
    return result


def timings(evs: list[dict], steps: list[dict], target: str, fault_t: float, done_before: int) -> dict:
    restart_t = next(e["t"] for e in evs if e["kind"] == "restart" and e["t"] > fault_t)
    repaired_t = restart_t
    if target.startswith("inference"):
        repaired_t = next(e["t"] for e in evs if e["kind"] == "server_state" and e["state"] == "up" and e["t"] > fault_t)
    fresh = [e for e in steps if e["t"] > fault_t and e["step"] > done_before and not e.get("replayed")]
    back = next(e["t"] for e in fresh if e["t"] > repaired_t)
    return {"restart_s": round(restart_t - fault_t, 1), "back_s": round(back - fault_t, 1),
            "first_step_s": round(fresh[0]["t"] - fault_t, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--sft", type=int, default=5)
    ap.add_argument("--at", type=int, default=8, help="inject after this RL step")
    ap.add_argument("--hang-timeout", type=float, default=10.0, help="run.hang_timeout_s")
    ap.add_argument("--faults", default="all", help="comma-separated names from FAULTS, or all")
    args = ap.parse_args()
    chosen = list(FAULTS) if args.faults == "all" else [f.strip() for f in args.faults.split(",")]
    out = Path(tempfile.mkdtemp(prefix="prl-recovery-"))
    base = one_run(out, "no-fault", args, None)
    report = {"no fault": {**base, "ratio_to_no_fault": 1.0}}
    print(f"{'no fault':<22} {base['steps_per_min']:6.1f} steps/min", flush=True)
    for i, fault in enumerate(chosen):
        r = one_run(out, f"fault{i}", args, FAULTS[fault])
        r["ratio_to_no_fault"] = round(r["steps_per_min"] / base["steps_per_min"], 2)
        report[fault] = r
        print(f"{fault:<22} {r['steps_per_min']:6.1f} steps/min ({r['ratio_to_no_fault']:.2f}x)  restarted after "
              f"{r['restart_s']:.1f} s, new step after the repair {r['back_s']:.1f} s, first new step "
              f"{r['first_step_s']:.1f} s", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""Runs seen from their directories: `prl runs` lists them, `prl stop` stops one, `prl status --json`
describes one. Everything is read from the run's event log (`metrics.jsonl`); the driver records its
pid in the first `run` event, and a clean stop is SIGTERM to it (handled as Ctrl-C is: every process
of the run is stopped before the driver exits)."""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from prl.tui.state import RunState, pid_alive, summarize
from prl.tui.status import snapshot

STATES = {"running": "running", "finished": "finished", "done": "finished", "failed": "failed",
          "interrupted": "stopped", "driver gone": "failed"}  # "done": a run of an earlier version


class RunsError(ValueError):
    """A directory that is not what the command needs; the message says what to do."""


@dataclass
class RunFacts:
    name: str
    dir: str
    state: str  # running | finished | failed | stopped
    rl_steps: int
    max_steps: int | None
    last_reward: float | None
    started: float | None  # unix time
    pid: int | None  # the driver's, while it runs


def load(run_dir: Path) -> RunState:
    """The run's folded event log, dead processes marked; `RunsError` when `run_dir` is no run."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunsError(f"{run_dir}: no such directory (give a run directory, e.g. runs/reverse-tiny)")
    if not (run_dir / "metrics.jsonl").is_file():
        raise RunsError(f"{run_dir}: not a prl run directory (no metrics.jsonl; `prl runs` lists the runs)")
    return snapshot(run_dir)


def facts(run_dir: Path, state: RunState | None = None) -> RunFacts:
    state = state or load(run_dir)
    curve = state.reward_curve()
    run = state.run
    return RunFacts(
        name=run.get("name") or Path(run_dir).name, dir=str(run_dir),
        state=STATES.get(run.get("state", ""), run.get("state") or "starting"), rl_steps=len(curve),
        max_steps=run.get("max_steps"), last_reward=curve[-1] if curve else None, started=run.get("started"),
        pid=run.get("pid") if run.get("state") == "running" else None,
    )


def find_runs(root: Path) -> list[Path]:
    """Run directories under `root` (itself, its children, or its grandchildren: `runs/` holds one
    folder per run, and a test or bench may hold a runs folder of its own), by start time."""
    root = Path(root)
    if not root.is_dir():
        raise RunsError(f"{root}: no such directory (prl runs lists the runs under run.output_dir, default runs/)")
    found = [d for d in (root, *root.glob("*"), *root.glob("*/*")) if (d / "metrics.jsonl").is_file()]
    return sorted(found, key=lambda d: (d / "metrics.jsonl").stat().st_mtime)


def runs_table(root: Path) -> list[RunFacts]:
    return [facts(d) for d in find_runs(root)]


def format_runs(rows: list[RunFacts]) -> str:
    head = ("NAME", "STATE", "STEPS", "LAST REWARD", "STARTED", "DIR")
    lines = [head] + [(
        r.name, r.state, f"{r.rl_steps}/{r.max_steps}" if r.max_steps else str(r.rl_steps),
        "-" if r.last_reward is None or math.isnan(r.last_reward) else f"{r.last_reward:.3f}",
        datetime.fromtimestamp(r.started).strftime("%Y-%m-%d %H:%M") if r.started else "-", r.dir,
    ) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def status_json(run_dir: Path) -> dict:
    """`prl status --json`: what the dashboard shows, as data; `eval`: per eval set, its last eval and
    the change since its first (`prl.tui.evals.set_summary`)."""
    state = load(run_dir)
    f = facts(run_dir, state)
    out = {**asdict(f), "run": state.run, "summary": summarize(state) if f.rl_steps else None,
           "trainer": state.trainer, "sft": state.sft, "orchestrator": state.orch, "servers": state.servers,
           "server_states": state.server_states, "processes": state.processes, "restarts": state.restarts,
           "errors": state.errors, "eval": state.eval_summary()}
    return jsonable(out)


def jsonable(x):
    """NaN and infinities as null (JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def stop(run_dir: Path, timeout_s: float, say=print) -> None:
    """SIGTERM to the run's driver (the same clean stop as Ctrl-C), then wait until it has recorded
    its end and exited. `RunsError` for a run that is not running, or one that did not stop in time."""
    f = facts(run_dir)
    if f.state != "running" or f.pid is None:
        raise RunsError(f"{run_dir}: the run is not running (state: {f.state}); nothing to stop")
    if not is_driver(f.pid):
        raise RunsError(f"{run_dir}: its driver (pid {f.pid}) is gone or is another program now; nothing to stop")
    os.kill(f.pid, signal.SIGTERM)
    say(f"prl stop: sent SIGTERM to {f.name}'s driver (pid {f.pid}); waiting for every process to stop")
    deadline = time.monotonic() + timeout_s
    while pid_alive(f.pid) and is_driver(f.pid):
        if time.monotonic() > deadline:
            raise RunsError(f"{run_dir}: the driver (pid {f.pid}) is still stopping after {timeout_s:.0f}s; wait, "
                            f"or run `prl stop` again")
        time.sleep(0.2)


def is_driver(pid: int) -> bool:
    """Whether `pid` is still a prl process (a pid left by a driver that died may be reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: trust the pid
        return pid_alive(pid)
    return b"prl" in cmdline

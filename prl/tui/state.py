"""Fold the run's event log (metrics.jsonl) into one snapshot; the TUI and `prl status` share it."""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from prl.metrics import read_events
from prl.tui.curves import CurveSet
from prl.tui.evals import EvalLog


STEPS_KEPT = 10_000  # trainer_step events kept for the plain output to print (the dashboard reads none)
LOCAL_HOSTS = ("local", "workstation")  # pids of processes on other hosts mean nothing here


@dataclass
class RunState:
    run: dict = field(default_factory=dict)
    processes: dict[str, dict] = field(default_factory=dict)
    trainer: dict = field(default_factory=dict)
    sft: dict = field(default_factory=dict)
    orch: dict = field(default_factory=dict)
    rewards: dict[int, float] = field(default_factory=dict)
    servers: dict[str, dict] = field(default_factory=dict)
    rollouts: dict = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    server_states: dict[str, str] = field(default_factory=dict)  # up / down (cause), as the orchestrator sees them
    restarts: dict[str, dict] = field(default_factory=dict)  # unit -> its last restart event
    unresponsive: list[dict] = field(default_factory=list)  # hang reports, for the driver
    seen: dict[str, int] = field(default_factory=dict)  # events per source: the driver's proof of life
    curves: CurveSet = field(default_factory=CurveSet)  # the whole run, one value per step
    evals: EvalLog = field(default_factory=EvalLog)  # every eval, per set in step order
    latest_sample: dict | None = None  # the last sample the orchestrator kept (samples/steps.jsonl), where it is here
    # trainer_step events and start-up notices (processes, the orchestrator's state, servers, restarts), for `--no-tui`
    steps: deque = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))
    offset: int = 0

    def apply(self, e: dict) -> None:
        kind = e.get("kind")
        src = e.get("src", "")
        self.seen[src] = self.seen.get(src, 0) + 1
        self.curves.add(e)
        if kind == "run":
            self.run.update(e)
        elif kind == "process":
            self.processes.setdefault(e["name"], {}).update(e)
            self.steps.append(e)
        elif kind == "trainer_step":
            (self.sft if e.get("stage") == "sft" else self.trainer).update(e)
            self.steps.append(e)
        elif kind == "orch_step":
            self.orch.update(e)
            self.rewards[e["step"]] = e["reward"]
        elif kind == "server":
            self.servers[e["name"]] = e
        elif kind == "rollouts":
            self.rollouts = e
        elif kind == "error":
            self.errors[e["name"]] = e["line"]
        elif kind == "server_state":
            self.server_states[e["name"]] = e["state"] + (f" ({e['cause'][:60]})" if e.get("cause") else "")
            self.steps.append(e)
        elif kind == "restart":
            self.restarts[e["name"]] = e
            self.steps.append(e)
        elif kind == "orchestrator":
            self.steps.append(e)
        elif kind == "unresponsive":
            self.unresponsive.append(e)
        elif kind == "eval":
            self.evals.add(e)

    def update_from(self, path: Path) -> "RunState":
        events, self.offset = read_events(path, self.offset)
        for e in events:
            self.apply(e)
        self.latest_sample = last_sample(Path(path).parent) or self.latest_sample
        return self

    def reward_curve(self) -> list[float]:
        return [self.rewards[k] for k in sorted(self.rewards)]

    def eval_summary(self) -> dict[str, dict]:
        """Per eval set: its last eval and the change since its first (`prl.tui.evals.set_summary`)."""
        return self.evals.summary()

    def mark_dead_processes(self) -> None:
        """For `prl status`: a local process the log calls running whose pid is gone is shown as
        gone; a run whose driver is gone is marked so, and its remote processes as stopping (their
        watchdog stops them once the driver's heartbeat is missed)."""
        driver = self.run.get("pid")
        driver_gone = self.run.get("state") == "running" and driver is not None and not pid_alive(driver)
        if driver_gone:
            self.run["state"] = "driver gone"
        for p in self.processes.values():
            if p.get("state") != "running" or not p.get("pid"):
                continue
            if p.get("host", "local") in LOCAL_HOSTS:
                if not pid_alive(p["pid"]):
                    p["state"] = "gone"
            elif driver_gone:
                p["state"] = "stopping (driver gone)"


def last_sample(run_dir: Path, tail: int = 16384) -> dict | None:
    """The last whole sample line of `run_dir/samples/steps.jsonl` (read from its end), or None."""
    path = run_dir / "samples" / "steps.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - tail))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def load_state(run_dir: Path) -> RunState:
    return RunState().update_from(Path(run_dir) / "metrics.jsonl")


def summarize(state: RunState, window: int = 5) -> dict:
    curve = state.reward_curve()
    first, last = curve[:window], curve[-window:]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "rl_steps": len(curve),
        "first5_reward": mean(first),
        "last5_reward": mean(last),
        "improvement": mean(last) - mean(first),
        "stale_dropped_total": state.orch.get("stale_dropped_total", 0),
        "eval": state.eval_summary(),
    }

"""Keeping a run going through faults: which process to restart, when, and when to give up.

Rules:
- a process that exits before the run is done, or is reported hung, is restarted on its host with
  the same command, at most `run.max_restarts` times; past that (or with 0) the run stops, naming it
  (a hung one is detected and killed whatever `max_restarts` is: with 0 its hang stops the run);
- the trainer's processes are one unit: any rank that dies takes the others down and all restart
  together (from the newest checkpoint, replaying the batches after it: `prl.trainer.ledger`); so
  are a multi-host engine's leader and its workers (`ProcessSpec.unit`);
- hangs: the orchestrator reports a server or trainer endpoint that stops answering (`unresponsive`
  events); the driver itself watches the orchestrator, which logs at least every few seconds. A hung
  unit is SIGKILLed (a stopped process cannot honour TERM) and restarted like a dead one;
- every restart is a `restart` event (unit, count, cause) in metrics.jsonl, shown by the TUI and
  `prl status`.
"""

from __future__ import annotations

import contextlib
import time

from prl.launch.hosts import HostError
from prl.launch.supervisor import Supervisor
from prl.metrics import EventLog
from prl.tui.state import RunState


class RestartFailed(RuntimeError):
    """A unit could not be stopped or started again: the run stops, naming it."""


class Faults:
    def __init__(self, sup: Supervisor, log: EventLog, max_restarts: int, hang_timeout_s: float):
        self.sup, self.log = sup, log
        self.max_restarts, self.hang_timeout_s = max_restarts, hang_timeout_s
        self.counts: dict[str, int] = {}
        self.started: dict[str, float] = {}  # unit -> wall time of its last (re)start
        self.hung: dict[str, tuple[str, float]] = {}  # unit -> (why it was killed as hung, when)
        self.seen_reports = 0
        # orchestrator -> (its events seen, when that count was first seen; None until its first new event)
        self.quiet_since: dict[str, tuple[int, float | None]] = {}

    def unit(self, name: str) -> str:
        spec = self.sup.procs[name].spec
        return "trainer" if spec.role == "trainer" else spec.unit or name

    def members(self, unit: str) -> list[str]:
        return [n for n in self.sup.procs if self.unit(n) == unit]

    def mark_started(self) -> None:
        now = time.time()
        for name in self.sup.procs:
            self.started[self.unit(name)] = now

    def restart(self, name: str, cause: str) -> bool:
        """Restart the unit of `name` if its budget allows; False when the run must stop instead."""
        unit = self.unit(name)
        count = self.counts.get(unit, 0) + 1
        if count > self.max_restarts:
            return False
        self.counts[unit] = count
        cause = self.hung.pop(unit, (cause, 0.0))[0]
        try:
            problems = self.sup.restart(self.members(unit))
        except HostError as e:
            problems = [str(e)]
        if problems:
            raise RestartFailed(f"could not restart {unit} ({cause}): {'; '.join(problems)}")
        self.started[unit] = time.time()
        self.quiet_since.pop(unit, None)
        self.log.emit("restart", name=unit, count=count, max_restarts=self.max_restarts, cause=cause[:300])
        for n in self.members(unit):
            p = self.sup.procs[n]
            self.log.emit("process", name=n, role=p.spec.role, host=p.spec.host, pid=p.pid, state="running",
                          restarts=count)
        return True

    def exhausted(self, name: str) -> str:
        """Why a unit that exited stops the run: killed as hung or stuck (the cause), past its restarts."""
        unit = self.unit(name)
        hung = self.hung.get(unit)
        why = f", killed by prl as {hung[0]}" if hung else ""
        if not self.max_restarts:
            return why + (" (run.max_restarts = 0)" if hung else "")
        return f"{why} after {self.counts.get(unit, 0)} restarts of {unit} (run.max_restarts = {self.max_restarts})"

    def check_hangs(self, state: RunState, hosts_answering: bool = True) -> None:
        """Kill units reported hung, and an orchestrator that has logged nothing for hang_timeout_s
        since its first event (its start-up, imports included, is not a hang; nor is silence while
        the hosts' logs cannot be fetched)."""
        for e in state.unresponsive[self.seen_reports:]:
            unit = e["name"] if e["name"] == "trainer" or e["name"] in self.sup.procs else None
            if unit and e["t"] > self.started.get(unit, 0):
                self.kill(unit, f"{'stuck' if e.get('stuck') else 'hung'}: {e.get('cause', '')}")
        self.seen_reports = len(state.unresponsive)
        for unit, (_, when) in list(self.hung.items()):  # a kill that did not take: allow another
            if time.monotonic() - when > 15:
                del self.hung[unit]
        orch = self.sup.procs.get("orchestrator")
        if orch is None or orch.code is not None or not hosts_answering:
            self.quiet_since.pop("orchestrator", None)
            return
        now_count = state.seen.get("orchestrator", 0)
        count, since = self.quiet_since.setdefault("orchestrator", (now_count, None))
        if now_count != count:
            self.quiet_since["orchestrator"] = (now_count, time.monotonic())
        elif since is not None and time.monotonic() - since > self.hang_timeout_s:
            self.kill("orchestrator", f"hung: no events for {self.hang_timeout_s:.0f}s")

    def kill(self, unit: str, cause: str) -> None:
        """SIGKILL a hung (or stuck) unit; its exit is then handled like any other: restarted while its
        budget allows, else the run stops naming it and this cause (`exhausted`)."""
        if unit in self.hung:
            return  # already being killed
        self.hung[unit] = (cause, time.monotonic())
        then = "restart it" if self.counts.get(unit, 0) < self.max_restarts else "stop the run (no restarts left)"
        self.log.emit("error", name=unit, line=f"{cause}; killing it to {then}")
        with contextlib.suppress(HostError):
            self.sup.kill(self.members(unit))

"""Start, watch and stop the run's processes on this machine.

Rule: nothing survives the run. Every process is the leader of its own process group (so a
torchrun and its workers go together), gets SIGKILL if the driver itself dies (PR_SET_PDEATHSIG),
and `stop_all` sends SIGTERM to every group, waits out a grace period, then SIGKILLs what is left.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections import deque

from prl.launch.plan import ProcessSpec

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the driver's stop_all still applies
        pass


class LocalProcess:
    def __init__(self, spec: ProcessSpec):
        self.spec = spec
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        self.spec.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.spec.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.spec.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.spec.env}, start_new_session=True, preexec_fn=_die_with_parent,
            )

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # pgid == pid: the process leads its own group
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self) -> bool:
        if self.proc is None:
            return False
        self.proc.poll()
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def tail(self, n: int = 15) -> list[str]:
        try:
            with open(self.spec.log, "rb") as f:
                f.seek(max(0, os.path.getsize(self.spec.log) - 16384))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return []
        return list(deque((ln for ln in lines if ln.strip()), maxlen=n))


class Supervisor:
    def __init__(self, specs: list[ProcessSpec]):
        self.procs = {s.name: LocalProcess(s) for s in specs}

    def start_all(self) -> None:
        for p in self.procs.values():
            p.start()

    def exited(self) -> dict[str, int]:
        return {name: rc for name, p in self.procs.items() if (rc := p.poll()) is not None}

    def stop_all(self, grace_s: float = 5.0) -> None:
        for p in self.procs.values():
            p.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.group_alive() for p in self.procs.values()):
            time.sleep(0.05)
        for p in self.procs.values():
            p.signal_group(signal.SIGKILL)
            if p.proc:
                try:
                    p.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass

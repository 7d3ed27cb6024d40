"""An optional cgroup v2 per execution: memory.max over all its processes together (rlimits are per
process), pids.max, swap off, and reliable reasons ("memory" from oom_kill, "procs" from pids.max).

Used when a cgroup v2 hierarchy with the memory and pids controllers can be created under this
process's own cgroup (or under $PRL_SANDBOX_CGROUP, a delegated cgroup v2 folder). When it cannot
(cgroup v1 hosts, controllers not delegated, no permission), `create` returns None and an execution
is limited by rlimits alone: memory per process (RLIMIT_AS, address space rather than resident
memory), processes per execution uid (RLIMIT_NPROC), and the "memory" reason is inferred from the
program's own out-of-memory error message.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from pathlib import Path
from typing import Optional

from prl.sandbox.result import MiB, Limits


def _v2_mount() -> Optional[Path]:
    """Where the cgroup v2 hierarchy is mounted (pure v2: /sys/fs/cgroup; hybrid: .../unified)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        if right.split(" ")[0] == "cgroup2":
            return Path(left.split(" ")[4])
    return None


@functools.lru_cache(maxsize=None)
def parent() -> Optional[Path]:
    """The cgroup v2 folder executions are created under, if one offers memory and pids."""
    if os.environ.get("PRL_SANDBOX_CGROUP"):
        base = Path(os.environ["PRL_SANDBOX_CGROUP"])
    else:
        mount = _v2_mount()
        own = [ln[3:] for ln in Path("/proc/self/cgroup").read_text().splitlines() if ln.startswith("0::")]
        if mount is None or not own:
            return None
        base = mount / own[0].lstrip("/")
    try:
        controllers = set((base / "cgroup.controllers").read_text().split())
    except OSError:
        return None
    return base if {"memory", "pids"} <= controllers else None


class Cgroup:
    """One execution's cgroup: created with its limits, joined by the command's first process."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def create(cls, limits: Limits) -> Optional["Cgroup"]:
        """A new cgroup with `limits`, or None where cgroup v2 is not usable (see the module doc)."""
        base = parent()
        if base is None:
            return None
        path = base / f"prl-sandbox-{uuid.uuid4().hex[:12]}"
        try:
            path.mkdir()
            if not {"memory", "pids"} <= set((path / "cgroup.controllers").read_text().split()):
                raise OSError("memory and pids controllers not delegated")
            (path / "memory.max").write_text(str(limits.memory_mb * MiB))
            (path / "pids.max").write_text(str(limits.max_procs))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
        except OSError:
            cls(path).remove()
            return None
        return cls(path)

    def join_argv(self) -> list[str]:
        """A prefix that moves the command's first process into the cgroup before it execs the rest."""
        return ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', str(self.path / "cgroup.procs")]

    def _count(self, name: str, key: str) -> int:
        try:
            for line in (self.path / name).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
        except (OSError, ValueError):
            pass
        return 0

    def oom_kills(self) -> int:
        return self._count("memory.events", "oom_kill")

    def pids_refused(self) -> int:
        return self._count("pids.events", "max")

    def peak_mb(self) -> float:
        try:
            return int((self.path / "memory.peak").read_text()) / MiB
        except (OSError, ValueError):
            return 0.0

    def cpu_s(self) -> float:
        return self._count("cpu.stat", "usage_usec") / 1e6

    def remove(self) -> None:
        """Kill whatever is left in it (cgroup.kill, Linux 5.14+) and remove it."""
        try:
            if (self.path / "cgroup.kill").exists():
                (self.path / "cgroup.kill").write_text("1")
        except OSError:
            pass
        for i in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(min(0.001 * 2 ** i, 0.05))

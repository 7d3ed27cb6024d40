"""The sandbox's records: the limits of one execution, its result, and the refusal error."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Optional

MiB = 1 << 20


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot be had on this machine (no namespaces, no bwrap, not root...).

    Raised before anything runs, so an environment can surface it instead of running untrusted code
    with less isolation than it asked for."""


@dataclass(frozen=True)
class Limits:
    """What one execution may use. Every limit is per execution; see `prl.sandbox` for which are per
    process (rlimits) and which cover the whole execution (wall time, output, a cgroup when present)."""

    timeout_s: float = 10.0          # wall clock, whole execution
    memory_mb: int = 512             # RLIMIT_AS per process; memory.max of the cgroup when present
    cpu_s: Optional[float] = None    # RLIMIT_CPU per process; None: the wall timeout, rounded up
    max_procs: int = 64              # RLIMIT_NPROC of the execution's own uid; pids.max with a cgroup
    max_output_bytes: int = 1 * MiB  # per stream (stdout, stderr); past it the program is stopped
    max_file_mb: int = 64            # RLIMIT_FSIZE: largest file it may write
    max_open_files: int = 256        # RLIMIT_NOFILE
    tmp_mb: int = 64                 # size of its private /tmp (a tmpfs; namespaces isolation only)

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "max_procs", "max_output_bytes", "max_file_mb",
                     "max_open_files", "tmp_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox limit {name} must be positive, got {getattr(self, name)}")
        if self.cpu_s is not None and self.cpu_s <= 0:
            raise ValueError(f"sandbox limit cpu_s must be positive, got {self.cpu_s}")

    @property
    def cpu_seconds(self) -> int:
        """The RLIMIT_CPU soft limit in whole seconds (the kernel counts whole seconds)."""
        return max(1, math.ceil(self.cpu_s if self.cpu_s is not None else self.timeout_s))


@dataclass
class Result:
    """What one execution did. `exit_code` follows the shell convention in every isolation mode:
    128 + N when the program died of signal N (then `signal` names it). `killed_reason` says why prl
    or the kernel stopped it: None (it ended on its own), "timeout", "output", "cpu", "memory",
    "file_size", "procs" (cgroup pids.max hit, only with a cgroup), "signal" (any other signal),
    "cancelled" (its `cancel` event was set) or "error" (prl itself failed while watching it).
    "memory" without a cgroup is read from the program's own out-of-memory message. `cpu_s` and
    `max_rss_mb` cover the program and the processes reaped in its pid namespace (namespaces) or
    that it waited for itself (isolation "none")."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: Optional[str]
    wall_s: float
    cpu_s: float
    max_rss_mb: Optional[float]  # None: not above the caller's own peak, which Linux carries into the child
    signal: Optional[str] = None
    isolation: str = "namespaces"
    cgroup: bool = False

    @property
    def ok(self) -> bool:
        """The program ended on its own with exit code 0."""
        return self.exit_code == 0 and self.killed_reason is None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

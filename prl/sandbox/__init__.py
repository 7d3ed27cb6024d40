"""A sandbox for model-written code: `run(code) -> Result`, and `SandboxPool` for asyncio callers.

Each execution (isolation "namespaces", the default):
- runs in a fresh working directory (seen as /work, removed afterwards) as its own unprivileged
  kernel uid (one per execution, from $PRL_SANDBOX_UID_BASE, default 1900000000, 4096 of them), with
  no capabilities and no_new_privs;
- inside bubblewrap's new mount, pid, network, ipc and uts namespaces: read-only /usr, /lib*, /bin
  and the Python prefix, a fresh /proc showing only its own processes, a minimal /dev, a size-capped
  /tmp; no host folder but its own, no network but its own loopback, an empty environment;
- under rlimits: address space (memory), CPU seconds, processes (RLIMIT_NPROC of its uid, which is
  why the uid is real and not root mapped in a user namespace: root ignores RLIMIT_NPROC), file
  size, open files, no core dumps;
- under a cgroup v2 (memory over all its processes, pids) when this machine offers one; without
  one, memory is limited per process only (see `prl.sandbox.cgroup`);
- stopped as a whole at its wall timeout or when stdout or stderr passes its cap (output is cut
  there, with a marker): bwrap's process group is killed, which takes down its pid namespace, and
  every process of its uid is killed after it ended in any case, so nothing it started survives.

`Result.killed_reason` says why an execution was stopped: "timeout", "output", "cpu", "memory",
"file_size", "procs" (cgroup only), "signal", "cancelled" (SandboxPool task cancelled), or None.

Isolation "none" (only when asked for) keeps the uid, rlimits, directory and kills, without
namespaces: the program then sees the host's files that are world-readable, and its network.
Where namespaces or bwrap are not available, `run` raises SandboxUnavailable instead.
prl must run as root (it needs to switch to the execution's uid).
"""

from prl.sandbox.isolation import ISOLATIONS, check
from prl.sandbox.pool import SandboxPool
from prl.sandbox.result import Limits, Result, SandboxUnavailable
from prl.sandbox.runner import LANGUAGES, run

__all__ = ["ISOLATIONS", "LANGUAGES", "Limits", "Result", "SandboxPool", "SandboxUnavailable", "check", "run"]

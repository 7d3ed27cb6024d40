"""How an execution is walled off: its own uid, its rlimits, and (by default) bubblewrap namespaces.

The command line of one execution is, from the outside in:
  [sh -c 'join cgroup'] bwrap <namespaces, binds> -- python INIT prlimit <rlimits> --
  setpriv <uid drop> -- PROGRAM
bwrap runs as root (no user namespace: a uid mapped in one would still be root outside), builds the
mount, pid, network, ipc and uts namespaces, and keeps only the capabilities setpriv needs to drop to
the execution's uid; setpriv then clears every capability, the bounding set and sets no_new_privs.
With isolation "none" the bwrap part is left out: rlimits and the uid drop only.
"""

from __future__ import annotations

import fcntl
import functools
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from prl.sandbox.result import MiB, Limits, SandboxUnavailable

ISOLATIONS = ("namespaces", "none")
# Each execution runs as its own uid from this range, so RLIMIT_NPROC counts only its processes and
# "every process of that uid" is exactly what it started. No passwd entry is needed for a kernel uid.
UID_BASE = int(os.environ.get("PRL_SANDBOX_UID_BASE", "1900000000"))
UID_SLOTS = 4096
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


def tool(name: str) -> str:
    """The absolute path of a host tool the sandbox needs, or SandboxUnavailable naming it."""
    path = shutil.which(name, path=SANDBOX_PATH + ":/usr/sbin:/sbin")
    if path is None:
        raise SandboxUnavailable(f"the sandbox needs `{name}` (Debian: apt-get install "
                                 f"{'bubblewrap' if name == 'bwrap' else 'util-linux'})")
    return path


def python_prefixes() -> list[str]:
    """The folders the sandbox's Python interpreter lives in (bound read-only when outside /usr)."""
    found = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    return sorted(p for p in found if not p.startswith("/usr/") and p != "/usr")


def sandbox_python(isolation: str = "namespaces") -> str:
    """The base interpreter (not the venv: its site-packages and paths stay out of the sandbox).
    Without namespaces (no read-only bind) the execution's uid must reach it through the host's
    folders: when it cannot (a pyenv under /root), the system's /usr/bin/python3 is used."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    if isolation == "namespaces" or others_can_reach(exe):
        return exe
    if others_can_reach("/usr/bin/python3"):
        return "/usr/bin/python3"
    raise SandboxUnavailable(f"isolation \"none\": other users cannot reach {exe}, and there is no "
                             "/usr/bin/python3")


def others_can_reach(path) -> bool:
    """Whether a user with no relation to the owner can walk to `path` and read it."""
    path = Path(path)
    try:
        folders_ok = all(os.stat(p).st_mode & 0o001 for p in path.parents)
        return folders_ok and os.stat(path).st_mode & 0o004 != 0
    except OSError:
        return False


def rlimit_argv(limits: Limits) -> list[str]:
    """prlimit's command line: the per-process limits, set as root just before the uid drop."""
    cpu = limits.cpu_seconds
    return [tool("prlimit"), f"--as={limits.memory_mb * MiB}", f"--cpu={cpu}:{cpu + 1}",
            f"--nproc={limits.max_procs}", f"--fsize={limits.max_file_mb * MiB}",
            f"--nofile={limits.max_open_files}", "--core=0", "--"]


def setpriv_argv(uid: int) -> list[str]:
    """setpriv's command line: become `uid` for good (no groups, no capabilities, no_new_privs)."""
    return [tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]


def _system_binds() -> list[str]:
    """Read-only views of /usr and the interpreter; /bin, /lib... as links where the host has links."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for prefix in python_prefixes():
        for parent in reversed(Path(prefix).parents[:-1]):  # bwrap would create them 0700
            args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", prefix, prefix]
    return args


def bwrap_argv(work: Path, limits: Limits) -> list[str]:
    """bwrap's command line: new mount/pid/net/ipc/uts namespaces, the execution's directory at
    /work (its only writable place besides a size-capped /tmp), a fresh /proc, a minimal /dev."""
    return [tool("bwrap"), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "sandbox", "--as-pid-1", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
            "--cap-add", "CAP_SETPCAP", *_system_binds(), "--proc", "/proc", "--dev", "/dev",
            "--perms", "1777", "--size", str(limits.tmp_mb * MiB), "--tmpfs", "/tmp",
            "--bind", str(work), "/work", "--chdir", "/work", "--clearenv",
            *[a for k, v in sandbox_env("/work").items() for a in ("--setenv", k, v)], "--"]


def sandbox_env(home: str) -> dict[str, str]:
    """The whole environment a program sees: nothing of the host's (no tokens, no keys)."""
    return {"PATH": SANDBOX_PATH, "HOME": home, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}


# The pid namespace's init (bwrap --as-pid-1), running as root without capabilities: it starts the
# program, reaps every process orphaned in the namespace (zombies count against RLIMIT_NPROC), and
# exits with the program's status (128 + N for signal N) as soon as the program ends, which makes
# the kernel kill everything left in the namespace. bwrap's own init is not used: its outer process
# does not wait for it, which leaves a zombie on hosts whose init does not reap, and hides the
# namespace's CPU time from our wait4.
INIT = """
import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execv(sys.argv[1], sys.argv[1:])
    except OSError as e:
        os.write(2, f"prl sandbox: cannot start {sys.argv[1]}: {e}\\n".encode())
        os._exit(127)
while True:
    done, status = os.waitpid(-1, 0)
    if done == pid:
        code = os.waitstatus_to_exitcode(status)
        os._exit(128 - code if code < 0 else code)
"""


def wrap(isolation: str, uid: int, work: Path, limits: Limits, program: list[str]) -> list[str]:
    """The full command line of one execution (see the module docstring)."""
    inner = rlimit_argv(limits) + setpriv_argv(uid) + program
    if isolation == "none":
        return inner
    return bwrap_argv(work, limits) + [sandbox_python(), "-I", "-S", "-c", INIT] + inner


@functools.lru_cache(maxsize=None)
def _probe(isolation: str) -> str:
    """'' when `isolation` works here, else why not (cached: the kernel does not change under us)."""
    if os.geteuid() != 0:
        return ("the sandbox runs each execution as its own unprivileged uid, which needs root "
                "(CAP_SETUID); run prl as root, e.g. in its container")
    try:
        with tempfile.TemporaryDirectory(prefix="prl-sandbox-probe-") as d:
            os.chown(d, UID_BASE + UID_SLOTS, 0)
            os.chmod(d, 0o770)
            argv = wrap(isolation, UID_BASE + UID_SLOTS, Path(d), Limits(), ["/bin/true"])
            out = subprocess.run(argv, cwd=d, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    except SandboxUnavailable as e:
        return str(e)
    if out.returncode != 0:
        return (f"`{' '.join(argv[:1])}` could not build the sandbox here (exit {out.returncode}: "
                f"{out.stderr.decode(errors='replace').strip()[-300:]})")
    return ""


def check(isolation: str) -> None:
    """Raise SandboxUnavailable unless `isolation` works on this machine; "none" must be asked for."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"sandbox isolation must be one of {ISOLATIONS}, got {isolation!r}")
    why = _probe(isolation)
    if why and isolation == "namespaces":
        raise SandboxUnavailable(f"refusing to run untrusted code: {why}. Pass isolation=\"none\" "
                                 "(recipe: sandbox.isolation = \"none\") to run with rlimits and a "
                                 "uid drop only")
    if why:
        raise SandboxUnavailable(f"refusing to run untrusted code: {why}")


def lock_dir() -> Path:
    d = Path(os.environ.get("PRL_SANDBOX_LOCKS", Path(tempfile.gettempdir()) / "prl-sandbox-uids"))
    d.mkdir(mode=0o700, exist_ok=True)
    return d


@contextmanager
def lease_uid():
    """A uid no other execution (in this or any other process) holds: an flock per slot, held for
    the execution. A slot's leftovers from a crashed holder are killed before it is handed out."""
    slots = list(range(UID_SLOTS))
    start = random.randrange(UID_SLOTS)
    for slot in slots[start:] + slots[:start]:
        fd = os.open(lock_dir() / f"{slot}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            kill_uid(UID_BASE + slot)
            yield UID_BASE + slot
        finally:
            os.close(fd)
        return
    raise SandboxUnavailable(f"all {UID_SLOTS} sandbox uids are in use")


def uid_pids(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real, effective, saved or fs uid is `uid`."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if "Z" not in fields.get("State", "") and str(uid) in fields.get("Uid", "").split():
            pids.append(int(entry.name))
    return pids


def kill_uid(uid: int, rounds: int = 50) -> bool:
    """SIGKILL every process of `uid`, as that uid: kill(-1) walks the task list under a lock, so a
    fork bomb cannot outrun it. True when none is left (zombies awaiting their parent excepted)."""
    for i in range(rounds):
        if not uid_pids(uid):
            return True
        subprocess.run([*setpriv_argv(uid), tool("kill"), "-9", "--", "-1"],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(min(0.001 * 2 ** i, 0.05))
    return not uid_pids(uid)

"""One sandboxed execution: stage the program in a fresh directory, run it walled off and limited,
watch its output and clock, kill everything it started, remove the directory, report."""

from __future__ import annotations

import os
import re
import resource
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence, Union

from prl.sandbox import isolation as iso
from prl.sandbox.cgroup import Cgroup
from prl.sandbox.result import MiB, Limits, Result, SandboxUnavailable

# language -> (file name in the working directory, command that runs it given a Python interpreter)
LANGUAGES = {
    "python": ("main.py", lambda f, python: [python, "-I", "-S", "-B", f]),  # -S: no site (stdlib only; 40% faster start)
    "sh": ("main.sh", lambda f, python: ["/bin/sh", f]),
    "bash": ("main.sh", lambda f, python: ["/bin/bash", f]),
}
SUFFIXES = {".py": "python", ".sh": "sh", ".bash": "bash"}
DRAIN_S = 2.0  # after the program ended or was stopped, how long its pipes may stay open
OOM_TEXT = re.compile(rb"MemoryError|Cannot allocate memory|std::bad_alloc|[Oo]ut of memory")


def run(code_or_file: Union[str, bytes, os.PathLike], *, language: Optional[str] = None,
        timeout_s: float = 10.0, memory_mb: int = 512, cpu_s: Optional[float] = None,
        max_procs: int = 64, max_output_bytes: int = MiB, files: Optional[dict] = None,
        stdin: Union[str, bytes, None] = None, isolation: str = "namespaces",
        args: Sequence[str] = (), limits: Optional[Limits] = None,
        cancel: Optional[threading.Event] = None) -> Result:
    """Run a program in a fresh sandbox and return what it did (see `prl.sandbox`).

    `code_or_file`: source text (str or bytes), or a path (os.PathLike) to a file whose content is
    run; `language` defaults to the file's suffix, else Python. `files` ({relative path: str|bytes})
    are placed next to it in the working directory; `args` are its command-line arguments; `stdin`
    is its standard input (else /dev/null). `limits`, when given, replaces the limit arguments.
    Setting `cancel` stops the execution (killed_reason "cancelled"). Raises SandboxUnavailable,
    before running anything, when `isolation` cannot be had here; ValueError for a bad language
    or file name. Blocks until the execution has ended: asyncio callers use SandboxPool."""
    if limits is None:
        limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s, max_procs=max_procs,
                        max_output_bytes=max_output_bytes)
    iso.check(isolation)
    with iso.lease_uid() as uid, _workdir(uid, isolation) as outer:
        program = _stage(code_or_file, language, files or {}, outer / "work", uid,
                         iso.sandbox_python(isolation)) + list(args)
        return _execute(isolation, uid, outer, limits, program, stdin, cancel)


@contextmanager
def _workdir(uid: int, isolation: str):
    """A fresh folder whose `work` subfolder (owned by `uid`) is the execution's working directory;
    removed afterwards whatever happened. $PRL_SANDBOX_TMP chooses where (default: the temp dir)."""
    outer = Path(tempfile.mkdtemp(prefix="prl-sandbox-", dir=os.environ.get("PRL_SANDBOX_TMP")))
    try:
        if isolation == "none" and not all(os.stat(p).st_mode & 0o001 for p in outer.parents):
            raise SandboxUnavailable(f"isolation \"none\": the execution's uid cannot reach {outer.parent}; "
                                     "set PRL_SANDBOX_TMP to a folder other users may enter")
        os.chmod(outer, 0o711)
        (outer / "work").mkdir()
        os.chown(outer / "work", uid, 0)  # group root: bwrap (root without capabilities) enters it
        os.chmod(outer / "work", 0o770)
        yield outer
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def _stage(code_or_file, language: Optional[str], files: dict, work: Path, uid: int,
           python: str) -> list[str]:
    """Write the program and its files into `work` (owned by `uid`); return its command line."""
    if isinstance(code_or_file, os.PathLike):
        path = Path(code_or_file)
        language = language or SUFFIXES.get(path.suffix, "python")
        source = path.read_bytes()
    else:
        language = language or "python"
        source = code_or_file
    if language not in LANGUAGES:
        raise ValueError(f"sandbox language must be one of {sorted(LANGUAGES)}, got {language!r}")
    name, command = LANGUAGES[language]
    for rel, data in {**files, name: source}.items():
        _place(work, rel, data, uid)
    return command(name, python)


def _place(work: Path, rel: str, data: Union[str, bytes], uid: int) -> None:
    """Write one file under `work`, refusing paths that would leave it."""
    target = (work / rel).resolve()
    if Path(rel).is_absolute() or work.resolve() not in target.parents:
        raise ValueError(f"sandbox file {rel!r} must be a relative path inside the working directory")
    for folder in reversed([p for p in target.parents if work.resolve() in p.parents]):
        folder.mkdir(exist_ok=True)
        os.chown(folder, uid, uid)
    target.write_bytes(data.encode() if isinstance(data, str) else bytes(data))
    os.chown(target, uid, uid)


@contextmanager
def _stdin(outer: Path, data: Union[str, bytes, None]):
    """The program's stdin: nothing, or `data` from a root-only file outside its working directory."""
    if data is None:
        yield subprocess.DEVNULL
        return
    path = outer / "stdin"
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    os.chmod(path, 0o600)
    with open(path, "rb") as f:
        yield f


def _execute(isolation: str, uid: int, outer: Path, limits: Limits, program: list[str],
             stdin, cancel: Optional[threading.Event]) -> Result:
    """Start the walled-off command, watch it, kill what is left, and build the Result."""
    work = outer / "work"
    cgroup = Cgroup.create(limits)
    argv = iso.wrap(isolation, uid, work, limits, program)
    if cgroup is not None:
        argv = cgroup.join_argv() + argv
    env = iso.sandbox_env(str(work) if isolation == "none" else "/work")
    if isolation == "none":
        env["TMPDIR"] = str(work)
    watch = None
    try:
        with _stdin(outer, stdin) as stdin_f:
            proc = subprocess.Popen(argv, cwd=work, env=env, stdin=stdin_f, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
        watch = _Watch(proc, limits, uid, cancel)
        watch.run()
    finally:
        if watch is not None:
            watch.finish()
        iso.kill_uid(uid)
        if cgroup is not None:
            cgroup.remove()
    return _result(watch, limits, cgroup, isolation)


class _Watch:
    """Reads a running execution's output under its caps and enforces its wall clock."""

    def __init__(self, proc: subprocess.Popen, limits: Limits, uid: int, cancel: Optional[threading.Event]):
        self.proc, self.limits, self.uid, self.cancel = proc, limits, uid, cancel
        self.start = time.monotonic()
        self.out_fd, self.err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        self.buf = {self.out_fd: bytearray(), self.err_fd: bytearray()}
        self.over: set[int] = set()
        self.reason: Optional[str] = None
        self.stopped_at = 0.0
        self.exited_at: Optional[float] = None
        self.status: Optional[int] = None
        self.rusage = None
        # Linux keeps a process's peak RSS across fork and exec: the command starts with ours as its
        # peak, so a peak not above it cannot be told from ours
        self.parent_rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.wall_s = 0.0

    def run(self) -> None:
        """Until the program has ended and its pipes are closed (or DRAIN_S after it ended or was
        stopped): read output; stop it at the deadline, on overflowing output or on `cancel`."""
        sel = selectors.DefaultSelector()
        for fd in self.buf:
            sel.register(fd, selectors.EVENT_READ)
        pidfd = _pidfd(self.proc.pid)
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ)
        tick = 0.02 if pidfd is None else 0.1 if self.cancel is not None else 1.0
        deadline = self.start + self.limits.timeout_s
        try:
            while self.status is None or any(k.fd in self.buf for k in sel.get_map().values()):
                now = time.monotonic()
                if self.reason is None and (now >= deadline or (self.cancel is not None and self.cancel.is_set())):
                    self.stop("timeout" if now >= deadline else "cancelled")
                # once it ended or was stopped, its pipes get DRAIN_S to close; `finish` does the rest
                ended = self.stopped_at if self.reason is not None else self.exited_at
                end = deadline if ended is None else ended + DRAIN_S
                if now >= end:
                    break
                for key, _ in sel.select(min(end - now, tick)):
                    if key.fd in self.buf:
                        self._read(key.fd, sel)
                if self.status is None and self._reap():
                    if pidfd is not None:
                        sel.unregister(pidfd)
                    iso.kill_uid(self.uid)  # what it left behind may still hold the pipes
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)

    def _read(self, fd: int, sel: selectors.BaseSelector) -> None:
        data = os.read(fd, 1 << 16)
        if not data:
            sel.unregister(fd)
            return
        buf, cap = self.buf[fd], self.limits.max_output_bytes
        room = cap - len(buf)
        if room > 0:
            buf += data[:room]
        if len(data) > room:
            self.over.add(fd)
            if self.reason is None:
                self.stop("output")

    def stop(self, reason: str) -> None:
        """Kill every process of the execution's uid: the program and all it started. The command
        around it (bwrap, its init) then ends on its own within DRAIN_S, or `finish` kills it."""
        if self.reason is None:
            self.reason, self.stopped_at = reason, time.monotonic()
        iso.kill_uid(self.uid)

    def _reap(self, block: bool = False) -> bool:
        pid, status, rusage = os.wait4(self.proc.pid, 0 if block else os.WNOHANG)
        if pid == 0:
            return False
        self.exited_at = time.monotonic()
        self.wall_s = self.exited_at - self.start
        self.status, self.rusage = status, rusage
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        return True

    def finish(self) -> None:
        """Whatever happened above: the command is dead and reaped, its pipes closed."""
        if self.status is None:
            self.reason = self.reason or "error"
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # bwrap's group: its pid namespace goes too
            except ProcessLookupError:
                pass
            self._reap(block=True)
        self.proc.stdout.close()
        self.proc.stderr.close()


def _pidfd(pid: int) -> Optional[int]:
    """A descriptor that becomes readable when `pid` exits (Linux 5.3+), or None: poll instead."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _result(watch: _Watch, limits: Limits, cgroup: Optional[Cgroup], isolation: str) -> Result:
    """Turn what the watch saw into a Result, naming why the program was stopped if it was."""
    code = watch.proc.returncode
    code = 128 - code if code < 0 else code  # the shell convention in both isolation modes
    sig = _signal_name(code)
    cpu = watch.rusage.ru_utime + watch.rusage.ru_stime
    rss_kb = watch.rusage.ru_maxrss
    if cgroup is not None:
        cpu = max(cpu, cgroup.cpu_s())
    out, err = (bytes(watch.buf[fd]) for fd in (watch.out_fd, watch.err_fd))
    reason = watch.reason or _kernel_reason(code, sig, cpu, err, limits, cgroup)
    return Result(exit_code=code, stdout=_text(out, watch.out_fd in watch.over, "stdout", limits),
                  stderr=_text(err, watch.err_fd in watch.over, "stderr", limits),
                  timed_out=reason == "timeout", killed_reason=reason, wall_s=round(watch.wall_s, 4),
                  cpu_s=round(cpu, 4),
                  max_rss_mb=round(rss_kb / 1024, 2) if rss_kb > watch.parent_rss_kb else None,
                  signal=sig, isolation=isolation, cgroup=cgroup is not None)


def _signal_name(code: int) -> Optional[str]:
    """SIGKILL for 137 and so on (bwrap reports a signalled program as 128 + N, like a shell)."""
    if code <= 128:
        return None
    try:
        return signal.Signals(code - 128).name
    except ValueError:
        return None


def _kernel_reason(code: int, sig: Optional[str], cpu: float, stderr: bytes, limits: Limits,
                   cgroup: Optional[Cgroup]) -> Optional[str]:
    """Why a limit enforced by the kernel (not by the watch) ended the program, if one did."""
    if cgroup is not None and cgroup.oom_kills():
        return "memory"
    if sig == "SIGXCPU" or (sig == "SIGKILL" and cpu >= limits.cpu_seconds):
        return "cpu"
    if sig == "SIGXFSZ":
        return "file_size"
    if code != 0 and OOM_TEXT.search(stderr[-4096:]):
        return "memory"  # an allocation refused by RLIMIT_AS, as the program itself reported it
    if code != 0 and cgroup is not None and cgroup.pids_refused():
        return "procs"
    return "signal" if sig else None


def _text(data: bytes, over: bool, name: str, limits: Limits) -> str:
    """Decoded output, with a marker saying where it was cut when it overflowed its cap."""
    text = data.decode("utf-8", errors="replace")
    if over:
        text += (f"\n[prl sandbox: {name} truncated at {limits.max_output_bytes} bytes; "
                 "the program was stopped]\n")
    return text

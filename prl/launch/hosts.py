"""One host interface, two implementations: this machine and a host reached over SSH (fabric).

Operations: run a command; start a long-lived process in its own process group with its log
captured in a file on that host; read the log from an offset (streaming); stop the process group
(TERM, then KILL after a grace period); check it is alive; copy files both ways.

Rules: a remote process is started under `setsid`, so its pid is its process-group id and
stopping it reaches every child (torchrun workers included). SSH host keys are checked against
known_hosts; an unknown key is refused unless `trust_unknown_hosts` is set. Passwords are never
used or logged: key files only.
"""

from __future__ import annotations

import abc
import base64
import os
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from prl.system import die_with_parent


class HostError(RuntimeError):
    """A host could not be reached or refused an operation; the message names the host."""


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str


NO_STATUS = -255  # a remote process that left no exit status (killed together with its group)


def exit_file(log: str) -> str:
    return f"{log}.exit"


def _watchdog(heartbeat: str, timeout_s: int) -> str:
    """A loop in the process group that stops the group (TERM, then KILL) once `heartbeat` is older
    than `timeout_s`: remote processes do not outlive a driver that died or lost its network.
    It ignores TERM only once it acts, so a normal teardown stops it with everything else."""
    hb = shlex.quote(heartbeat)
    return (f"( while sleep 2; do now=$(date +%s); t=$(stat -c %Y {hb} 2>/dev/null || echo $now); "
            f"if [ $((now - t)) -gt {timeout_s} ]; then trap '' TERM; "
            f"echo 'prl: no heartbeat from the driver for {timeout_s}s; stopping'; "
            f"kill -s TERM -- -$$; sleep 10; kill -s KILL -- -$$; fi; done ) & wd=$!; ")


def _launch_line(cmd: list[str], log: str, env: dict[str, str], heartbeat: tuple[str, int] | None = None) -> str:
    """Shell line that starts `cmd` as a new session leader with output to `log`, printing its pid.
    The leader is a `sh` that waits for `cmd` and writes its exit status next to the log; with
    `heartbeat` (file, timeout) a watchdog stops the group when the driver stops touching the file."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    status = shlex.quote(exit_file(log))
    guard, unguard = (_watchdog(*heartbeat), "kill $wd 2>/dev/null; ") if heartbeat else ("", "")
    inner = f"rm -f {status}; {guard}{exports} {shlex.join(cmd)}; rc=$?; {unguard}echo $rc > {status}"
    # `;` not `&&`: only the setsid command goes to the background, so no subshell keeps the
    # session's stdout open (an SSH channel would stay open until the process exits)
    return (f"mkdir -p {shlex.quote(str(Path(log).parent))} || exit 1; "
            f"setsid sh -c {shlex.quote(inner)} >> {shlex.quote(log)} 2>&1 < /dev/null & echo $!")


class Host(abc.ABC):
    name: str

    @abc.abstractmethod
    def run(self, command: str, timeout: float = 60) -> Result: ...

    @abc.abstractmethod
    def put(self, local: str | Path, remote: str) -> None: ...

    @abc.abstractmethod
    def get(self, remote: str, local: str | Path) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional: only hosts holding a connection override it
        """Release the connection, if any."""

    def start(self, cmd: list[str], log: str, env: dict[str, str] | None = None,
              heartbeat: tuple[str, int] | None = None) -> int:
        """Start a long-lived process group; returns its pid (== its pgid). `heartbeat`: (file,
        timeout s) - the group stops itself when the file is not touched for that long."""
        r = self.run(_launch_line(cmd, log, env or {}, heartbeat))
        if r.code != 0 or not r.stdout.strip().isdigit():
            raise HostError(f"{self.name}: could not start {cmd[0]}: {r.stderr.strip() or r.stdout.strip()}")
        return int(r.stdout.strip())

    def poll(self, pid: int, log: str) -> int | None:
        """None while the process group runs; then the exit status (NO_STATUS if it left none)."""
        r = self.run(self._state_command(pid, log))
        return self._state(pid, r.stdout if r.code == 0 else "")

    def survey(self, groups: list[tuple[int, str]], files: list[tuple[str, int]]) -> tuple[list, list[bytes]]:
        """A driver's look at this host in one round trip: each process group's state (`poll` of (pid, log)),
        then each file's bytes from its offset (`read_log` of (path, offset)), read after the states so a
        process seen exited has its last lines read."""
        parts = [self._state_command(pid, log) for pid, log in groups]
        parts += [f"printf 'R '; tail -c +{offset + 1} {shlex.quote(path)} 2>/dev/null | base64 -w0; echo"
                  for path, offset in files]
        r = self.run("; ".join(parts) or "true")
        lines = r.stdout.splitlines() if r.code == 0 else []
        if len(lines) != len(parts):  # a cut-off answer
            raise HostError(f"{self.name}: no clear answer to the driver's look (code {r.code}: {r.stdout[-300:]!r})")
        states = [self._state(pid, line) for (pid, _), line in zip(groups, lines)]
        return states, [base64.b64decode(line[2:].strip()) for line in lines[len(groups):]]

    def _state_command(self, pid: int, log: str) -> str:
        status = shlex.quote(exit_file(log))
        return (f"if {self._group_probe(pid)}; then echo running; elif [ -s {status} ]; "
                f"then echo exit $(cat {status}); else echo gone; fi")

    def _state(self, pid: int, answer: str) -> int | None:
        out = answer.split()
        if not out or out[0] not in ("running", "exit", "gone"):  # a cut-off answer
            raise HostError(f"{self.name}: no clear answer about pid {pid} ({answer!r})")
        if out[0] == "running":
            return None
        return int(out[1]) if out[0] == "exit" and out[1:] and out[1].lstrip("-").isdigit() else NO_STATUS

    @staticmethod
    def _group_probe(pid: int) -> str:
        return f"ps -e -o pgid=,stat= | awk -v g={pid} '$1 == g && $2 !~ /^Z/ {{f = 1}} END {{exit !f}}'"

    def alive(self, pid: int) -> bool:
        """Any non-zombie process left in the group (a killed process stays a zombie until reaped)."""
        return self.run(self._group_probe(pid)).code == 0

    def signal(self, pid: int, sig: str) -> None:
        """Send `sig` ("TERM", "KILL") to the process group `pid`; a group already gone is fine."""
        self.run(f"kill -s {sig} -- -{pid} 2>/dev/null; true")

    def stop(self, pid: int, grace_s: float = 5.0) -> None:
        """TERM the process group, wait up to `grace_s`, then KILL what is left."""
        self.signal(pid, "TERM")
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self.alive(pid):
            time.sleep(0.1)
        self.signal(pid, "KILL")
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and self.alive(pid):
            time.sleep(0.05)

    def read_log(self, path: str, offset: int = 0) -> tuple[bytes, int]:
        """Bytes of `path` from `offset` (for streaming a log back); returns (data, new offset)."""
        r = self.run(f"tail -c +{offset + 1} {shlex.quote(path)} 2>/dev/null | base64 -w0")
        data = base64.b64decode(r.stdout.strip() or b"")
        return data, offset + len(data)


class LocalHost(Host):
    """This machine. Processes are children of the driver: they also get SIGKILL if the driver
    itself dies (PR_SET_PDEATHSIG), which a remote host cannot offer."""

    def __init__(self, name: str = "localhost"):
        self.name = name
        self.children: dict[int, subprocess.Popen] = {}

    def start(self, cmd: list[str], log: str, env: dict[str, str] | None = None,
              heartbeat: tuple[str, int] | None = None) -> int:
        """`heartbeat` is not needed here: children die with the driver (PR_SET_PDEATHSIG)."""
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**os.environ, **(env or {})}, start_new_session=True,
                                 preexec_fn=die_with_parent)
        self.children[p.pid] = p
        return p.pid

    def poll(self, pid: int, log: str) -> int | None:
        if pid not in self.children:
            return super().poll(pid, log)
        return self.children[pid].poll()  # -N: killed by signal N

    def survey(self, groups: list[tuple[int, str]], files: list[tuple[str, int]]) -> tuple[list, list[bytes]]:
        """Here each look costs no round trip: the children's own states, then the files."""
        return [self.poll(pid, log) for pid, log in groups], [self.read_log(path, off)[0] for path, off in files]

    def alive(self, pid: int) -> bool:
        if pid in self.children:
            self.children[pid].poll()  # reap, so a dead leader is not counted
        try:
            os.killpg(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return super().alive(pid)  # a group of zombies only is not alive

    def run(self, command: str, timeout: float = 60) -> Result:
        p = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=timeout)
        return Result(p.returncode, p.stdout, p.stderr)

    def put(self, local: str | Path, remote: str) -> None:
        Path(remote).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", str(local), remote], check=True)

    def get(self, remote: str, local: str | Path) -> None:
        self.put(remote, str(local))


@dataclass
class SshTarget:
    address: str
    user: str = "root"
    port: int = 22
    key_file: str | None = None
    known_hosts: str | None = None  # default: ~/.ssh/known_hosts
    trust_unknown_hosts: bool = False
    connect_timeout: float = 10.0


class SshHost(Host):
    def __init__(self, target: SshTarget):
        from fabric import Connection
        from paramiko import AutoAddPolicy, RejectPolicy

        self.target = target
        self.name = f"{target.user}@{target.address}:{target.port}"
        # no key_file: the SSH agent and the default keys, as `ssh` does (fabric refuses key_filename=None)
        auth = {"key_filename": target.key_file, "look_for_keys": False, "allow_agent": False} if target.key_file \
            else {"look_for_keys": True, "allow_agent": True}
        self.conn = Connection(
            host=target.address, user=target.user, port=target.port, connect_timeout=target.connect_timeout,
            connect_kwargs={**auth, "password": None},
        )
        client = self.conn.client
        client.load_host_keys(target.known_hosts) if target.known_hosts else client.load_system_host_keys()
        client.set_missing_host_key_policy(AutoAddPolicy() if target.trust_unknown_hosts else RejectPolicy())

    def _connect(self) -> None:
        import paramiko

        if self.conn.is_connected:
            return
        try:
            self.conn.open()
        except paramiko.SSHException as e:
            if "not found in known_hosts" in str(e):
                raise HostError(f"{self.name}: unknown host key (not in {self.target.known_hosts or 'known_hosts'}); "
                                f"add it with ssh-keyscan, or set trust_unknown_hosts for this host") from None
            raise HostError(f"{self.name}: ssh failed: {e}") from None
        except OSError as e:
            raise HostError(f"{self.name}: unreachable ({e})") from None

    def run(self, command: str, timeout: float = 60) -> Result:
        import paramiko
        from invoke.exceptions import CommandTimedOut

        self._connect()
        try:
            r = self.conn.run(command, hide=True, warn=True, timeout=timeout, in_stream=False)
        except CommandTimedOut:
            raise HostError(f"{self.name}: command timed out after {timeout}s") from None
        except (paramiko.SSHException, OSError, EOFError) as e:
            self.conn.close()  # the next call reconnects
            raise HostError(f"{self.name}: connection lost ({type(e).__name__}: {e})") from None
        return Result(r.exited, r.stdout, r.stderr)

    def put(self, local: str | Path, remote: str) -> None:
        self._connect()
        self.run(f"mkdir -p {shlex.quote(str(Path(remote).parent))}")
        self.conn.put(str(local), remote)

    def get(self, remote: str, local: str | Path) -> None:
        self._connect()
        self.conn.get(remote, str(local))

    def close(self) -> None:
        self.conn.close()

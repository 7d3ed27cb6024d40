"""Start, watch and stop the run's processes, on this machine or on remote hosts, through `Host`.

Rule: nothing survives the run. Every process leads its own process group on its host (so a
torchrun and its workers go together); `stop_all` TERMs every group on every host at once, waits
out a grace period, then KILLs what is left. Local processes also die with the driver
(PR_SET_PDEATHSIG, see `LocalHost`). Logs and metrics of remote processes are streamed back into
the run directory on the workstation (`sync`), so the TUI, `prl status` and error messages read
the same files for local and remote runs.
"""

from __future__ import annotations

import os
import shlex
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prl.launch.hosts import Host, HostError
from prl.launch.processes import ProcessSpec
from prl.metrics import append_lines


class HostProcess:
    def __init__(self, host: Host, spec: ProcessSpec):
        self.host, self.spec = host, spec
        self.pid: int | None = None
        self.code: int | None = None  # exit status, once seen
        self.log_offset = 0
        self.mirrored = spec.host_log != str(spec.log)
        self.seen = False  # `code` was just read by the supervisor's look at the host: the next poll takes it

    def start(self, heartbeat_s: int | None) -> None:
        self.spec.log.parent.mkdir(parents=True, exist_ok=True)
        beat = (heartbeat_file(self.spec.run_dir), heartbeat_s) if self.mirrored and heartbeat_s else None
        self.seen = False
        self.pid = self.host.start(self.spec.cmd, self.spec.host_log, self.spec.env, beat)

    def poll(self) -> int | None:
        if self.seen:
            self.seen = False
        elif self.code is None and self.pid is not None:
            self.code = self.host.poll(self.pid, self.spec.host_log)
        return self.code

    def pull_log(self) -> None:
        if self.mirrored and self.pid is not None:
            data, _ = self.host.read_log(self.spec.host_log, self.log_offset)
            self.append_log(data)

    def append_log(self, data: bytes) -> None:
        """Bytes of the host's log from `log_offset` on, appended to the workstation's copy."""
        if data:
            with open(self.spec.log, "ab") as f:
                f.write(data)
            self.log_offset += len(data)

    def tail(self, n: int = 15) -> list[str]:
        try:
            with open(self.spec.log, "rb") as f:
                f.seek(max(0, os.path.getsize(self.spec.log) - 16384))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return []
        return list(deque((ln for ln in lines if ln.strip()), maxlen=n))


class MetricsMirror:
    """Appends complete lines of a host's metrics.jsonl to the workstation's."""

    def __init__(self, host: Host, remote: str, local: Path):
        self.host, self.remote, self.local, self.offset = host, remote, local, 0

    def pull(self) -> None:
        self.append(self.host.read_log(self.remote, self.offset)[0])

    def append(self, data: bytes) -> None:
        """Bytes of the host's metrics from `offset` on: their complete lines go to the workstation's."""
        end = data.rfind(b"\n") + 1
        if end:
            append_lines(self.local, data[:end])
            self.offset += end


def heartbeat_file(run_dir: str) -> str:
    return f"{run_dir}/.driver-heartbeat"


class Supervisor:
    def __init__(self, specs: list[ProcessSpec], hosts: dict[str, Host], run_dir: Path,
                 heartbeat_s: int | None = None):
        """`heartbeat_s`: remote processes stop themselves when the driver has not touched their
        host's heartbeat file for that long (the driver died or lost the network)."""
        self.hosts, self.heartbeat_s, self.last_beat = hosts, heartbeat_s, 0.0
        self.procs = {s.name: HostProcess(hosts[s.host], s) for s in specs}
        remote_dirs = {(s.host, s.run_dir) for s in specs if s.host_log != str(s.log)}
        self.remote_dirs = sorted(remote_dirs)
        self.mirrors = [MetricsMirror(hosts[h], f"{d}/metrics.jsonl", run_dir / "metrics.jsonl")
                        for h, d in self.remote_dirs]
        self.pool = ThreadPoolExecutor(max(4, len(hosts)))

    @property
    def remote(self) -> bool:
        return bool(self.mirrors)

    def start_all(self) -> None:
        self.beat()
        for p in self.procs.values():
            p.start(self.heartbeat_s)

    def beat(self) -> None:
        """Touch every remote host's heartbeat file (at most every heartbeat_s / 5 seconds)."""
        if not self.heartbeat_s or time.monotonic() - self.last_beat < self.heartbeat_s / 5:
            return
        jobs = [self.pool.submit(self.hosts[h].run, f"touch {shlex.quote(heartbeat_file(d))}")
                for h, d in self.remote_dirs]
        for f in jobs:
            f.result()
        self.last_beat = time.monotonic()

    def exited(self) -> dict[str, int]:
        codes = self.pool.map(lambda p: p.poll(), self.procs.values())
        return {name: rc for name, rc in zip(self.procs, codes) if rc is not None}

    def sync(self) -> None:
        """Stream remote logs and metrics into the workstation's run directory, and see which remote
        processes exited (the next `exited` takes those states): one command per host."""
        self.beat()
        hosts = {p.spec.host for p in self.procs.values() if p.mirrored}
        hosts |= {k for k, h in self.hosts.items() if any(m.host is h for m in self.mirrors)}
        for f in [self.pool.submit(self.look, h) for h in sorted(hosts)]:
            f.result()

    def look(self, host: str) -> None:
        """One host's states, logs and metrics in one round trip (`Host.survey`)."""
        procs = [p for p in self.procs.values() if p.mirrored and p.spec.host == host and p.pid is not None]
        polled = [p for p in procs if p.code is None]
        mirrors = [m for m in self.mirrors if m.host is self.hosts[host]]
        states, data = self.hosts[host].survey([(p.pid, p.spec.host_log) for p in polled],
                                               [(p.spec.host_log, p.log_offset) for p in procs]
                                               + [(m.remote, m.offset) for m in mirrors])
        for p, code in zip(polled, states):
            p.code, p.seen = code, True
        for p, chunk in zip(procs, data):
            p.append_log(chunk)
        for m, chunk in zip(mirrors, data[len(procs):]):
            m.append(chunk)

    def stop_all(self, grace_s: float = 5.0) -> list[str]:
        """Stop every process group on every host; returns what could not be stopped (named)."""
        problems = self.stop(list(self.procs.values()), grace_s)
        try:
            self.sync()  # the last log lines and metrics
        except HostError as e:
            problems.append(f"could not fetch the last logs: {e}")
        return sorted(set(problems))

    def stop(self, procs: list[HostProcess], grace_s: float = 5.0) -> list[str]:
        """TERM these process groups at once, KILL what is left after `grace_s`; returns problems."""
        running = [p for p in procs if p.pid is not None]
        problems = []

        def each(sig: str):
            def signal_one(p: HostProcess):
                try:
                    p.host.signal(p.pid, sig)
                except HostError as e:
                    problems.append(f"{p.spec.name} on {p.spec.host}: {e}")
            list(self.pool.map(signal_one, running))

        each("TERM")
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(self.pool.map(_alive, running)):
            time.sleep(0.1)
        each("KILL")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(self.pool.map(_alive, running)):
            time.sleep(0.1)
        problems += [f"{p.spec.name} on {p.spec.host}: still running (pid {p.pid})" for p in running if _alive(p)]
        for p in running:
            p.poll()
        return problems

    def kill(self, names: list[str]) -> None:
        """SIGKILL these process groups now (hung: nothing to wait for); their exit is seen by polling."""
        for name in names:
            p = self.procs[name]
            if p.pid is not None and p.code is None:
                p.host.signal(p.pid, "KILL")

    def restart(self, names: list[str]) -> list[str]:
        """Stop what is left of these processes (e.g. the other ranks of a trainer), start them anew
        with the same command on the same host; returns problems stopping them (then none started)."""
        procs = [self.procs[n] for n in names]
        problems = self.stop(procs)
        if problems:
            return problems
        self.beat()
        for p in procs:
            p.pull_log()
            p.start(self.heartbeat_s)
            p.code = None  # only once started: a failed start leaves it exited, and the run stops
        return []

    def close(self) -> None:
        self.pool.shutdown()
        for h in self.hosts.values():
            h.close()


def _alive(p: HostProcess) -> bool:
    try:
        return p.host.alive(p.pid)
    except HostError:
        return False  # unreachable: reported by the signal step

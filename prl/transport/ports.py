"""Listening ports on one machine that cannot collide, and how a process's real address reaches the
processes that talk to it.

A port chosen in advance (by the driver, when it resolves the run) can be taken by any other process
before the role binds it. So on one machine a role binds its own socket: the port it was given if
that is free, else one the OS picks (`bind`); then it writes the address it got into the run
directory (`publish`: `RUN_DIR/ports/NAME.json`, replaced atomically). Whoever talks to it reads that
file (`lookup`), and reads it again after a failed connection: a restarted process may be on
another port. Roles whose port goes on another program's command line (vLLM, `mooncake_master`)
get it from `pick`, which probes the given port first; a race lost after that fails the start, and
the restart picks again (never the same taken port).

On a cluster ports are configured and checked before the run (`prl doctor`); a taken one fails with
the host, the port and the process holding it where it can be found (`holder`).
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

PORTS = "ports"


class PortTaken(OSError):
    """A configured port is in use (the message names the address and, if found, the holder)."""


def bind(host: str, port: int, fallback: bool) -> socket.socket:
    """A listening TCP socket on `host:port` (SO_REUSEADDR, as servers set it). With `fallback`, a
    port the OS picks when `port` is taken (or 0); without, `PortTaken` naming who holds it."""
    for candidate in ([port, 0] if fallback and port else [port]):
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, candidate))
            s.listen(128)
            return s
        except OSError as e:
            s.close()
            if e.errno != errno.EADDRINUSE or candidate == 0:
                raise
    raise PortTaken(errno.EADDRINUSE, taken_message(host, port))


def pick(host: str, ports: list[int]) -> list[int]:
    """Ports for a program that binds them itself: each given one if it can be bound now, else one
    the OS picks; all distinct."""
    out: list[int] = []
    for p in ports:
        if p and p not in out and free(host, p):
            out.append(p)
            continue
        while True:
            with bind(host, 0, fallback=False) as s:
                q = s.getsockname()[1]
            if q not in out and q not in ports:
                out.append(q)
                break
    return out


def free(host: str, port: int) -> bool:
    try:
        bind(host, port, fallback=False).close()
        return True
    except OSError:
        return False


def port_file(run_dir: str | Path, name: str) -> Path:
    return Path(run_dir) / PORTS / f"{name}.json"


def publish(run_dir: str | Path, name: str, host: str, ports: int | list[int]) -> None:
    """Tell the run where `name` listens (atomically: a reader sees the old file or the new one)."""
    path = port_file(run_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"host": host, "ports": [ports] if isinstance(ports, int) else ports,
                               "pid": os.getpid()}))
    os.replace(tmp, path)


def lookup(run_dir: str | Path, name: str) -> tuple[str, list[int]] | None:
    """(host, ports) that `name` published, or None while it has not."""
    try:
        data = json.loads(port_file(run_dir, name).read_text())
        return data["host"], [int(p) for p in data["ports"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def url_of(run_dir: str | Path, name: str, default: str) -> str:
    """`http://host:port` where `name` listens, or `default` while it has not published."""
    found = lookup(run_dir, name)
    if found is None:
        return default
    host, ports = found
    return f"http://{host}:{ports[0]}"


def holder(port: int) -> str | None:
    """The process listening on TCP `port` on this machine ("pid 123 (python)"), read from /proc; None
    where it cannot be found (another user's process without root, not Linux)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f[9])
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()) if inodes else ():
        if wanted & _links(pid):
            try:
                return f"pid {pid} ({Path(f'/proc/{pid}/comm').read_text().strip()})"
            except OSError:
                return f"pid {pid}"
    return None


def _links(pid: str) -> set[str]:
    """What a process's file descriptors point at (those that can be read: fds come and go)."""
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out


def taken_message(host: str, port: int) -> str:
    who = holder(port)
    return f"{host}:{port} is already in use" + (f" by {who}" if who else "")

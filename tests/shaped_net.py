"""Hosts joined by a network that behaves like one: each in its own network namespace on a private
bridge (`sshd_rig.Network`), every port's bandwidth shaped by tc's token bucket (tbf) in both
directions, so a process's exchanges wait on the wire instead of being a memcpy on the same cores.
Frames are jumbo (MTU 9000, as on a cluster's fabric): at 1500 bytes the kernel's per-packet work for
a step's exchanges took about a quarter of a core from the ranks' own compute, which a host's NIC does.

`torchrun(link, script, args, nproc)` starts one torchrun per host (`--nnodes` = hosts, rendezvous
on host 0's address), each rank's gloo on the namespace's interface. Used by tests/test_overlap.py
and bench/comm_overlap.py; needs root, `ip` and `tc` (iproute2)."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from sshd_rig import IFNAME, Network, free_subnet

BURST = "64kb"  # the bucket: a few TCP segments' worth, so the rate holds over milliseconds
LINKS = itertools.count()  # this process's links, each with its own names, subnet and port


def available() -> str | None:
    """Why a shaped network cannot be built here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    missing = [t for t in ("ip", "tc") if not shutil.which(t)]
    return f"needs {' and '.join(missing)} (iproute2)" if missing else None


class ShapedLink:
    """`hosts` namespaces on a bridge, each port shaped to `mbit` megabit/s each way. Its names and subnet
    differ from the session's sshd rig (`sshd_rig.Network`, named after the same pid), which may be up."""

    def __init__(self, hosts: int, mbit: float, mtu: int = 9000):
        self.net, self.mbit, n = Network(), mbit, next(LINKS)
        self.net.tag = (self.net.tag + 50 + n) % 100000  # each link of this process its own names and subnet
        self.port = 29533 + n % 100  # and its own rendezvous port
        self.net.subnet, self.net.bridge = free_subnet(self.net.tag), f"prlbr{self.net.tag}"
        self.places: list[tuple[str, str]] = []
        try:
            self.net.up()
            for i in range(hosts):
                ns, address = self.net.add_host(i)
                self.places.append((ns, address))
                port = f"prlv{self.net.tag}{i}"  # the bridge's port toward the host
                self.net.ip("-n", ns, "link", "set", IFNAME, "mtu", str(mtu))
                self.net.ip("link", "set", port, "mtu", str(mtu))
                self.shape(["ip", "netns", "exec", ns], IFNAME)  # leaving the host
                self.shape([], port)  # arriving
        except BaseException:
            self.net.down()
            raise

    def shape(self, prefix: list[str], dev: str) -> None:
        subprocess.run([*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.mbit}mbit",
                        "burst", BURST, "latency", "200ms"], check=True, capture_output=True, timeout=10)

    def down(self) -> None:
        self.net.down()

    def __enter__(self) -> "ShapedLink":
        return self

    def __exit__(self, *exc) -> None:
        self.down()


@contextmanager
def torchrun(link: ShapedLink, script: Path, args: list[str], nproc: int = 1,
             env: dict | None = None) -> Iterator[list[subprocess.Popen]]:
    """One torchrun per host of `link`, `nproc` ranks each; host 0's is first in the list. Each runs in its own
    session, killed with its ranks on leaving the block (a wait that timed out, a failed assertion)."""
    master, port = link.places[0][1], link.port
    procs = []
    try:
        for i, (ns, _address) in enumerate(link.places):
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
                   f"--nnodes={len(link.places)}", f"--node-rank={i}", f"--nproc-per-node={nproc}",
                   f"--master-addr={master}", f"--master-port={port}", str(script), *args]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          env={**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": IFNAME},
                                          cwd=script.parent, start_new_session=True))
        yield procs
    finally:
        for proc in procs:
            for pid in [*descendants(proc.pid), proc.pid] if proc.poll() is None else ():
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # the ranks first: torchrun starts each in its own session
            proc.wait()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), deepest last."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out

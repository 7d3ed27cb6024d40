"""Test rig: real sshd servers, one per simulated host, with keys generated per test session.

Preferred: each host in its own network namespace (`ip netns`), joined to a private bridge by a
veth pair, with its own 10.x address; processes started over SSH live in that namespace, so a
host reaches another only through its 10.x address. Where namespaces cannot be made (no root,
no iproute2), each host gets its own loopback address 127.0.0.N and port instead. Every server
is stopped by pid and every namespace, veth and bridge deleted when the fixture ends."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
IFNAME = "prl0"  # each namespaced host's interface (GLOO_SOCKET_IFNAME for trainers across hosts)


@dataclass
class FakeHost:
    address: str
    port: int
    proc: subprocess.Popen
    host_key_pub: str
    netns: str | None = None

    def known_hosts_line(self) -> str:
        where = self.address if self.port == 22 else f"[{self.address}]:{self.port}"
        return f"{where} {self.host_key_pub}"


def keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def start_sshd(root: Path, address: str, client_pub: Path, netns: str | None = None) -> FakeHost:
    root.mkdir(parents=True, exist_ok=True)
    host_key = keygen(root / "host_key")
    auth = root / "authorized_keys"
    auth.write_text(client_pub.read_text())
    auth.chmod(0o600)
    port = 22 if netns else free_port(address)
    config = root / "sshd_config"
    config.write_text("\n".join([
        f"ListenAddress {address}:{port}", f"HostKey {host_key}", f"AuthorizedKeysFile {auth}",
        f"PidFile {root / 'sshd.pid'}", "PermitRootLogin prohibit-password", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "LogLevel ERROR",
        "Subsystem sftp internal-sftp",
    ]) + "\n")
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege-separation directory sshd insists on
    prefix = ["ip", "netns", "exec", netns] if netns else []
    proc = subprocess.Popen([*prefix, SSHD, "-D", "-e", "-f", str(config)], stderr=open(root / "sshd.log", "wb"))
    deadline = time.time() + 60  # only how long a failure takes to show
    while True:
        try:
            socket.create_connection((address, port), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()  # a started sshd that cannot be reached is not left running
                raise RuntimeError(f"sshd on {address}:{port} did not start: {(root / 'sshd.log').read_text()}") from None
            time.sleep(0.05)
    pub = (root / "host_key.pub").read_text().split()
    return FakeHost(address, port, proc, f"{pub[0]} {pub[1]}", netns)


def free_subnet(tag: int) -> str:
    """10.S.0 with S from `tag`, moved on past any subnet an interface here already holds (a bridge another run
    left behind would otherwise take this network's packets)."""
    held = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=10).stdout \
        if shutil.which("ip") else ""
    for k in range(100):
        subnet = f"10.{100 + (tag + k) % 100}.0"
        if f" {subnet}." not in held:
            return subnet
    return f"10.{100 + tag % 100}.0"


class Network:
    """A private bridge with one namespace per host: 10.S.0.1 on the bridge, host i at 10.S.0.(i+2)."""

    def __init__(self):
        tag = os.getpid() % 100000
        self.subnet = free_subnet(tag)
        self.bridge, self.tag, self.names = f"prlbr{tag}", tag, []
        self.made: list[list[str]] = []  # undo commands, run in reverse

    def ip(self, *args: str, undo: list[str] | None = None) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)
        if undo:
            self.made.append(undo)

    def up(self) -> Network:
        self.ip("link", "add", self.bridge, "type", "bridge", undo=["link", "del", self.bridge])
        self.ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        self.ip("link", "set", self.bridge, "up")
        return self

    def add_host(self, i: int) -> tuple[str, str]:
        ns, veth, peer = f"prl{self.tag}h{i}", f"prlv{self.tag}{i}", f"prlp{self.tag}{i}"
        address = f"{self.subnet}.{i + 2}"
        self.ip("netns", "add", ns, undo=["netns", "del", ns])
        self.ip("link", "add", veth, "type", "veth", "peer", "name", peer, undo=["link", "del", veth])
        self.ip("link", "set", peer, "netns", ns)
        self.ip("-n", ns, "link", "set", peer, "name", IFNAME)  # the same name on every host, like eth0
        self.ip("link", "set", veth, "master", self.bridge)
        self.ip("link", "set", veth, "up")
        self.ip("-n", ns, "addr", "add", f"{address}/24", "dev", IFNAME)
        self.ip("-n", ns, "link", "set", IFNAME, "up")
        self.ip("-n", ns, "link", "set", "lo", "up")
        return ns, address

    def down(self) -> None:
        for undo in reversed(self.made):
            subprocess.run(["ip", *undo], capture_output=True, timeout=10)
        self.made.clear()


def start_hosts(root: Path, n: int, client_pub: Path) -> tuple[list[FakeHost], Network | None]:
    """n hosts in network namespaces if this machine allows it, else on loopback addresses."""
    net = None
    if os.environ.get("PRL_RIG", "netns") == "netns" and shutil.which("ip") and os.geteuid() == 0:
        try:
            net = Network().up()
            places = [net.add_host(i) for i in range(n)]
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            if net:
                net.down()
            net = None
    if net is None:
        places = [(None, f"127.0.0.{i + 2}") for i in range(n)]
    hosts: list[FakeHost] = []
    try:
        for i, (ns, address) in enumerate(places):
            hosts.append(start_sshd(root / f"h{i}", address, client_pub, ns))
    except BaseException:  # the hosts started and the network go with the failure: nothing is left behind
        stop_hosts(hosts, net)
        raise
    return hosts, net


def stop_hosts(hosts: list[FakeHost], net: Network | None) -> None:
    for h in hosts:
        h.proc.terminate()
        try:
            h.proc.wait(5)
        except subprocess.TimeoutExpired:
            h.proc.kill()
    if net:
        net.down()


def host_port(host: FakeHost) -> int:
    """A port free on that host, for a test's plan (any port is free in a fresh namespace)."""
    while True:  # below the ephemeral range (32768+), where outgoing connections could take it meanwhile
        port = random.randint(20000, 32000)
        if host.netns:
            return port
        with socket.socket() as s:
            try:
                s.bind((host.address, port))
                return port
            except OSError:
                continue

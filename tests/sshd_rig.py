"""Test rig: real sshd servers, one per simulated host, each on its own loopback address and port,
with keys generated per test session. Every server is stopped by pid when the fixture ends."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


@dataclass
class FakeHost:
    address: str
    port: int
    proc: subprocess.Popen
    host_key_pub: str

    def known_hosts_line(self) -> str:
        return f"[{self.address}]:{self.port} {self.host_key_pub}"


def keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def start_sshd(root: Path, address: str, client_pub: Path) -> FakeHost:
    root.mkdir(parents=True, exist_ok=True)
    host_key = keygen(root / "host_key")
    auth = root / "authorized_keys"
    auth.write_text(client_pub.read_text())
    auth.chmod(0o600)
    port = free_port(address)
    config = root / "sshd_config"
    config.write_text("\n".join([
        f"ListenAddress {address}:{port}", f"HostKey {host_key}", f"AuthorizedKeysFile {auth}",
        f"PidFile {root / 'sshd.pid'}", "PermitRootLogin prohibit-password", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "LogLevel ERROR",
        "Subsystem sftp internal-sftp",
    ]) + "\n")
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege-separation directory sshd insists on
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stderr=open(root / "sshd.log", "wb"))
    deadline = time.time() + 10
    while True:
        try:
            socket.create_connection((address, port), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"sshd on {address}:{port} did not start: {(root / 'sshd.log').read_text()}") from None
            time.sleep(0.05)
    pub = (root / "host_key.pub").read_text().split()
    return FakeHost(address, port, proc, f"{pub[0]} {pub[1]}")

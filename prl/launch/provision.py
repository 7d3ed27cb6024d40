"""Provisioning: install this project on every host of a cluster, in parallel, once per wheel.

Rules:
- the project is built into a wheel on the workstation; its key is a sha256 over the wheel's
  members (names and bytes, not the zip's timestamps) and the extras, so an unchanged project
  maps to the same key however often it is rebuilt;
- each host keeps one venv per key in `{workdir}/venvs/{key}`, built under a temporary name and
  renamed when complete (`.prl-ready` inside): a warm host only checks that marker;
- the venv is layered on `cluster.python`: that interpreter's site-packages are appended to the
  venv's path (a .pth file), so torch/CUDA from the host image are used, not downloaded; pip then
  installs only what is missing, and this project from the wheel.
"""

from __future__ import annotations

import hashlib
import shlex
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from prl.launch.hosts import Host, HostError
from prl.recipe.schema import ClusterCfg, HostCfg

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class ProvisionError(RuntimeError):
    pass


@dataclass
class Provisioned:
    host: str
    python: str  # the venv's interpreter on that host
    state: str  # "cold" (built now) or "warm" (reused)
    seconds: float


def build_wheel(out_dir: Path) -> Path:
    if not (PROJECT_ROOT / "pyproject.toml").is_file():
        raise ProvisionError(f"cannot build a wheel: no pyproject.toml in {PROJECT_ROOT} (install prl from source)")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out_dir), str(PROJECT_ROOT)], capture_output=True, text=True, check=False)
    wheels = sorted(Path(out_dir).glob("prl-*.whl"))
    if p.returncode or not wheels:
        raise ProvisionError(f"building the wheel failed: {p.stderr.strip()[-2000:]}")
    return wheels[-1]


def wheel_key(wheel: Path, extras: list[str]) -> str:
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            h.update(name.encode() + b"\0" + z.read(name) + b"\0")
    h.update(",".join(sorted(extras)).encode())
    return h.hexdigest()[:16]


def venv_dir(cluster: ClusterCfg, h: HostCfg, key: str) -> str:
    return f"{cluster.workdir_of(h)}/venvs/{key}"


def install_script(cluster: ClusterCfg, venv: str, wheel: str, extras: list[str]) -> str:
    q = shlex.quote
    tmp = f"{venv}.tmp-$$"
    req = wheel + (f"[{','.join(extras)}]" if extras else "")
    find_base = ("import site, sys; print(repr([p for p in site.getsitepackages() + "
                 "([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]))")
    return "\n".join([
        "set -e",
        f"rm -rf {tmp}",
        f"{q(cluster.python)} -m venv --without-pip {tmp}",
        f"base=$({q(cluster.python)} -c {q(find_base)})",
        f"site=$({tmp}/bin/python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')",
        "echo \"import sys; [sys.path.append(p) for p in $base if p not in sys.path]\" > $site/_prl_base.pth",
        f"{tmp}/bin/python -m pip install -q --no-input --disable-pip-version-check --no-deps --ignore-installed {q(wheel)}",
        f"{tmp}/bin/python -m pip install -q --no-input --disable-pip-version-check {q(req)}",
        f"{tmp}/bin/python -c 'import prl, torch'",
        f"touch {tmp}/.prl-ready",
        f"rm -rf {q(venv)} && mv {tmp} {q(venv)}",
    ])


def provision_host(host: Host, cluster: ClusterCfg, h: HostCfg, wheel: Path, key: str) -> Provisioned:
    t0 = time.perf_counter()
    venv = venv_dir(cluster, h, key)
    python = f"{venv}/bin/python"
    if host.run(f"test -f {shlex.quote(venv)}/.prl-ready").code == 0:
        return Provisioned(h.id, python, "warm", time.perf_counter() - t0)
    remote_wheel = f"{cluster.workdir_of(h)}/wheels/{key}/{wheel.name}"
    host.put(wheel, remote_wheel)
    r = host.run(install_script(cluster, venv, remote_wheel, cluster.extras), timeout=1800)
    if r.code != 0:
        raise HostError(f"{host.name}: installing prl into {venv} failed: {(r.stderr or r.stdout).strip()[-1500:]}")
    return Provisioned(h.id, python, "cold", time.perf_counter() - t0)


def provision(hosts: dict[str, Host], cluster: ClusterCfg, pool) -> tuple[dict[str, Provisioned], str]:
    """Build the wheel once, then provision every host in parallel. Raises naming each failed host."""
    with tempfile.TemporaryDirectory() as tmp:
        wheel = build_wheel(Path(tmp))
        key = wheel_key(wheel, cluster.extras)
        by_id = cluster.hosts_by_id()
        futures = {hid: pool.submit(provision_host, hosts[hid], cluster, by_id[hid], wheel, key) for hid in by_id}
        done, failed = {}, []
        for hid, f in futures.items():
            try:
                done[hid] = f.result()
            except HostError as e:
                failed.append(str(e))
    if failed:
        raise ProvisionError("provisioning failed, nothing was started:\n  " + "\n  ".join(failed))
    return done, key

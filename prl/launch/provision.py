"""Provisioning: install this project on every host of a cluster, in parallel, once per wheel.

Rules:
- the project is built into a wheel on the workstation; its key is a sha256 over the wheel's
  members (names and bytes, not the zip's timestamps) and the extras, so an unchanged project
  maps to the same key however often it is rebuilt;
- each host keeps one venv per key in `{workdir}/venvs/{key}`, built under a temporary name and
  renamed when complete (`.prl-ready` inside): a warm host only checks that marker; with
  `cluster.venv` set, that one environment is used instead (created if missing) and the project is
  reinstalled into it when the key in its `.prl-wheel` differs;
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
    return cluster.venv or f"{cluster.workdir_of(h)}/venvs/{key}"


def create_lines(cluster: ClusterCfg, target: str) -> list[str]:
    """A venv at `target` layered on cluster.python's site-packages (torch from the host image)."""
    q = shlex.quote
    find_base = ("import site, sys; print(repr([p for p in site.getsitepackages() + "
                 "([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]))")
    return [
        f"{q(cluster.python)} -m venv --without-pip {target}",
        f"base=$({q(cluster.python)} -c {q(find_base)})",
        f"site=$({target}/bin/python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')",
        "echo \"import sys; [sys.path.append(p) for p in $base if p not in sys.path]\" > $site/_prl_base.pth",
    ]


def install_script(cluster: ClusterCfg, venv: str, wheel: str, key: str) -> str:
    """Keyed venv (default): build under a temporary name, rename when complete. A fixed
    `cluster.venv`: create it if missing, (re)install this project into it, record the key."""
    q = shlex.quote
    pip = "-m pip install -q --no-input --disable-pip-version-check"
    req = wheel + (f"[{','.join(cluster.extras)}]" if cluster.extras else "")
    if cluster.venv:
        return "\n".join([
            "set -e", f"if [ ! -x {q(venv)}/bin/python ]; then", *create_lines(cluster, q(venv)), "fi",
            f"{q(venv)}/bin/python {pip} --no-deps --force-reinstall {q(wheel)}",
            f"{q(venv)}/bin/python {pip} {q(req)}",
            f"cd / && {q(venv)}/bin/python -c 'import prl, torch'",
            f"echo {key} > {q(venv)}/.prl-wheel",
        ])
    tmp = f"{venv}.tmp-$$"
    return "\n".join([
        "set -e", f"rm -rf {tmp}", *create_lines(cluster, tmp),
        f"{tmp}/bin/python {pip} --no-deps --ignore-installed {q(wheel)}",
        f"{tmp}/bin/python {pip} {q(req)}",
        f"cd / && {tmp}/bin/python -c 'import prl, torch'",
        f"touch {tmp}/.prl-ready",
        f"rm -rf {q(venv)} && mv {tmp} {q(venv)}",
    ])


def is_warm(host: Host, cluster: ClusterCfg, venv: str, key: str) -> bool:
    probe = (f"grep -qx {key} {shlex.quote(venv)}/.prl-wheel" if cluster.venv
             else f"test -f {shlex.quote(venv)}/.prl-ready")
    return host.run(probe).code == 0


def provision_host(host: Host, cluster: ClusterCfg, h: HostCfg, wheel: Path, key: str) -> Provisioned:
    t0 = time.perf_counter()
    venv = venv_dir(cluster, h, key)
    python = f"{venv}/bin/python"
    if is_warm(host, cluster, venv, key):
        return Provisioned(h.id, python, "warm", time.perf_counter() - t0)
    remote_wheel = f"{cluster.workdir_of(h)}/wheels/{key}/{wheel.name}"
    host.put(wheel, remote_wheel)
    r = host.run(install_script(cluster, venv, remote_wheel, key), timeout=1800)
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

"""`prl doctor recipe.toml`: check every host of a recipe's [cluster], in parallel, before launching.

Per host: reachable over SSH (host key verified), Python version, free disk in the work directory,
GPUs seen by `nvidia-smi` against what the recipe expects, every port the plan binds on that host
free, and the first trainer host reachable from every host on the rendezvous port. Prints one row per host and
returns the failures as "host: check: detail" lines (empty when all pass).
"""

from __future__ import annotations

import os
import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from prl.launch.hosts import Host, HostError, SshHost, SshTarget
from prl.recipe.schema import ClusterCfg, HostCfg

CHECKS = ("reachable", "python", "disk", "gpus", "port", "reach")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def connect(cfg: ClusterCfg, h: HostCfg) -> SshHost:
    key = os.path.expanduser(h.key_file) if h.key_file else None
    known = os.path.expanduser(cfg.known_hosts) if cfg.known_hosts else None
    return SshHost(SshTarget(h.address, h.user, h.port, key, known, cfg.trust_unknown_hosts))


def _py(cfg: ClusterCfg, code: str) -> str:
    return f"{shlex.quote(cfg.python)} -c {shlex.quote(code)}"


def basic_checks(host: Host, h: HostCfg, cfg: ClusterCfg) -> list[Check]:
    try:
        host.run("true", timeout=30)
    except HostError as e:
        return [Check("reachable", False, str(e))]
    out = [Check("reachable", True, "ssh ok")]
    out.append(python_check(host, cfg))
    workdir = cfg.workdir_of(h)
    r = host.run(f"mkdir -p {shlex.quote(workdir)} && df -Pk {shlex.quote(workdir)} | tail -1")
    free_gb = int(r.stdout.split()[3]) / 2**20 if r.code == 0 else 0.0
    out.append(Check("disk", free_gb >= cfg.min_free_gb, f"{free_gb:.1f} GB free in {workdir}"
                     if r.code == 0 else f"cannot use {workdir}: {r.stderr.strip()}"))
    out.append(gpu_check(host, h))
    return out


def python_check(host: Host, cfg: ClusterCfg) -> Check:
    """The interpreter runs, is new enough, and has torch: the run's venv builds on its packages
    (torch is never installed by prl: it must match the host's CUDA)."""
    r = host.run(_py(cfg, "import sys; print('%d.%d' % sys.version_info[:2]); import torch; print(torch.__version__)"))
    lines = r.stdout.split()
    if not lines:
        return Check("python", False, f"{cfg.python} not runnable: {r.stderr.strip()[-200:]}")
    new_enough = tuple(map(int, lines[0].split("."))) >= tuple(map(int, cfg.min_python.split(".")))
    if not new_enough:
        return Check("python", False, f"{lines[0]} < {cfg.min_python}")
    if r.code != 0 or len(lines) < 2:
        return Check("python", False, f"{cfg.python} ({lines[0]}) has no torch; point cluster.python at the "
                                      f"host's Python with torch installed")
    return Check("python", True, f"{lines[0]}, torch {lines[1]}")


def gpu_check(host: Host, h: HostCfg) -> Check:
    r = host.run("nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true")
    seen = int(r.stdout.strip() or 0)
    return Check("gpus", seen == h.gpus, f"{seen} seen, {h.gpus} expected")


def port_check(host: Host, h: HostCfg, cfg: ClusterCfg, ports: list[int]) -> Check:
    """Every port the plan binds on this host is free (SO_REUSEADDR, as the servers set it:
    a port in TIME_WAIT is free for them)."""
    code = ("import socket, sys\nbusy = []\n"
            f"for p in {sorted(set(ports))!r}:\n"
            "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"    try: s.bind(({h.address!r}, p))\n"
            "    except OSError: busy.append(p)\n"
            "    s.close()\n"
            "print(' '.join(map(str, busy))); sys.exit(1 if busy else 0)")
    r = host.run(_py(cfg, code))
    listed = ",".join(map(str, sorted(set(ports))))
    return Check("port", r.code == 0, f"{listed} free" if r.code == 0 else f"in use: {r.stdout.strip() or r.stderr.strip()}")


def reach_check(host: Host, first: HostCfg, cfg: ClusterCfg) -> Check:
    code = f"import socket; socket.create_connection(({first.address!r}, {cfg.rendezvous_port}), 5).close()"
    r = host.run(_py(cfg, code))
    where = f"{first.address}:{cfg.rendezvous_port}"
    return Check("reach", r.code == 0, f"reaches {where}" if r.code == 0 else f"cannot reach {where}")


def listener(cfg: ClusterCfg, first: HostCfg) -> list[str]:
    code = (f"import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(({first.address!r}, {cfg.rendezvous_port})); s.listen(64); s.settimeout(60)\n"
            f"while True: s.accept()[0].close()")
    return [cfg.python, "-c", code]


def check_cluster(cfg: ClusterCfg, console: Console, ports: dict[str, list[int]] | None = None,
                  first: str | None = None) -> dict[str, list[Check]]:
    """`ports`: host name -> ports the plan binds there; `first`: the rendezvous host (default: first)."""
    by_id = cfg.hosts_by_id()
    hosts = {hid: connect(cfg, h) for hid, h in by_id.items()}
    results: dict[str, list[Check]] = {}
    with Progress(console=console, transient=True) as progress, ThreadPoolExecutor(len(hosts)) as pool:
        task = progress.add_task("checking hosts", total=len(hosts) + 1)
        futures = {a: pool.submit(host_checks, hosts[a], by_id[a], cfg, (ports or {}).get(a)) for a in hosts}
        for a, f in futures.items():
            results[a] = f.result()
            progress.advance(task)
        reach_phase(cfg, hosts, results, pool, first or cfg.hosts[0].id)
        progress.advance(task)
    for host in hosts.values():
        host.close()
    return results


def host_checks(host: Host, h: HostCfg, cfg: ClusterCfg, ports: list[int] | None) -> list[Check]:
    out = basic_checks(host, h, cfg)
    if out[0].ok and ports:
        out.append(port_check(host, h, cfg, ports))
    return out


def reach_phase(cfg: ClusterCfg, hosts: dict[str, Host], results: dict[str, list[Check]], pool, first_id: str) -> None:
    """Every host reaches the rendezvous port on the first trainer host (a listener is started there)."""
    first = cfg.hosts_by_id()[first_id]
    if not results[first_id][0].ok or not all(c.ok for c in results[first_id] if c.name == "port"):
        return
    pid = hosts[first_id].start(listener(cfg, first), f"{cfg.workdir_of(first)}/doctor-listener.log")
    try:
        up = [a for a in hosts if results[a][0].ok]
        for a, check in zip(up, pool.map(lambda a: reach_check(hosts[a], first, cfg), up)):
            results[a].append(check)
    finally:
        hosts[first_id].stop(pid, grace_s=1.0)


def report(results: dict[str, list[Check]], console: Console) -> list[str]:
    table = Table(title="prl doctor", title_justify="left")
    table.add_column("host")
    for name in CHECKS:
        table.add_column(name)
    failures = []
    for address, checks in results.items():
        by_name = {c.name: c for c in checks}
        cells = []
        for name in CHECKS:
            c = by_name.get(name)
            cells.append("-" if c is None else f"[green]ok[/] {c.detail}" if c.ok else f"[red]FAIL[/] {c.detail}")
        table.add_row(address, *cells)
        failures += [f"{address}: {c.name}: {c.detail}" for c in checks if not c.ok]
    console.print(table)
    return failures

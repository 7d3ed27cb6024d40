"""`prl doctor recipe.toml`: check every host of a recipe's [cluster], in parallel, before launching.

Per host: reachable over SSH (host key verified), Python version, free disk in the work directory,
GPUs seen by `nvidia-smi` against what the recipe expects, the rendezvous port free on the first
host, and the first host reachable from every host on that port. Prints one row per host and
returns the failures as "host: check: detail" lines (empty when all pass).
"""

from __future__ import annotations

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
    return SshHost(SshTarget(h.address, h.user, h.port, h.key_file, cfg.known_hosts, cfg.trust_unknown_hosts))


def _py(cfg: ClusterCfg, code: str) -> str:
    return f"{shlex.quote(cfg.python)} -c {shlex.quote(code)}"


def basic_checks(host: Host, h: HostCfg, cfg: ClusterCfg) -> list[Check]:
    try:
        host.run("true", timeout=30)
    except HostError as e:
        return [Check("reachable", False, str(e))]
    out = [Check("reachable", True, "ssh ok")]
    r = host.run(_py(cfg, "import sys; print('%d.%d' % sys.version_info[:2])"))
    version = r.stdout.strip()
    ok = r.code == 0 and tuple(map(int, version.split("."))) >= tuple(map(int, cfg.min_python.split(".")))
    out.append(Check("python", ok, version if r.code == 0 else f"{cfg.python} not runnable: {r.stderr.strip()}"))
    r = host.run(f"mkdir -p {shlex.quote(cfg.workdir)} && df -Pk {shlex.quote(cfg.workdir)} | tail -1")
    free_gb = int(r.stdout.split()[3]) / 2**20 if r.code == 0 else 0.0
    out.append(Check("disk", free_gb >= cfg.min_free_gb, f"{free_gb:.1f} GB free in {cfg.workdir}"
                     if r.code == 0 else f"cannot use {cfg.workdir}: {r.stderr.strip()}"))
    out.append(gpu_check(host, h))
    return out


def gpu_check(host: Host, h: HostCfg) -> Check:
    r = host.run("nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true")
    seen = int(r.stdout.strip() or 0)
    return Check("gpus", seen == h.gpus, f"{seen} seen, {h.gpus} expected")


def port_check(host: Host, cfg: ClusterCfg) -> Check:
    # SO_REUSEADDR as the rendezvous store sets it: a port in TIME_WAIT is free for it
    code = (f"import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(('0.0.0.0', {cfg.rendezvous_port}))")
    r = host.run(_py(cfg, code))
    return Check("port", r.code == 0, f"{cfg.rendezvous_port} free" if r.code == 0 else f"{cfg.rendezvous_port} in use")


def reach_check(host: Host, first: HostCfg, cfg: ClusterCfg) -> Check:
    code = f"import socket; socket.create_connection(({first.address!r}, {cfg.rendezvous_port}), 5).close()"
    r = host.run(_py(cfg, code))
    where = f"{first.address}:{cfg.rendezvous_port}"
    return Check("reach", r.code == 0, f"reaches {where}" if r.code == 0 else f"cannot reach {where}")


def listener(cfg: ClusterCfg) -> list[str]:
    code = (f"import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(('0.0.0.0', {cfg.rendezvous_port})); s.listen(64); s.settimeout(60)\n"
            f"while True: s.accept()[0].close()")
    return [cfg.python, "-c", code]


def check_cluster(cfg: ClusterCfg, console: Console) -> dict[str, list[Check]]:
    hosts = {h.address: connect(cfg, h) for h in cfg.hosts}
    results: dict[str, list[Check]] = {}
    with Progress(console=console, transient=True) as progress, ThreadPoolExecutor(len(hosts)) as pool:
        task = progress.add_task("checking hosts", total=len(hosts) + 1)
        futures = {a: pool.submit(basic_checks, hosts[a], h, cfg) for a, h in zip(hosts, cfg.hosts)}
        for a, f in futures.items():
            results[a] = f.result()
            progress.advance(task)
        reach_phase(cfg, hosts, results, pool)
        progress.advance(task)
    for host in hosts.values():
        host.close()
    return results


def reach_phase(cfg: ClusterCfg, hosts: dict[str, Host], results: dict[str, list[Check]], pool) -> None:
    """The rendezvous port is free on the first host, and every host reaches it there."""
    first = cfg.hosts[0]
    if not results[first.address][0].ok:
        return
    port = port_check(hosts[first.address], cfg)
    results[first.address].append(port)
    if not port.ok:
        return
    pid = hosts[first.address].start(listener(cfg), f"{cfg.workdir}/doctor-listener.log")
    try:
        up = [a for a in hosts if results[a][0].ok]
        for a, check in zip(up, pool.map(lambda a: reach_check(hosts[a], first, cfg), up)):
            results[a].append(check)
    finally:
        hosts[first.address].stop(pid, grace_s=1.0)


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

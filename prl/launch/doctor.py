"""`prl doctor recipe.toml`: check every host of a recipe's [cluster], in parallel, before launching.

Per host: reachable over SSH (host key verified), Python version, free disk in the work directory,
GPUs seen by `nvidia-smi` against what the recipe expects, every port the plan binds on that host
free, the pretrained `model.path` folder on hosts that read it, vLLM importable on vLLM servers' hosts, and every connection the plan makes open (trainer ranks to the rendezvous, orchestrator to the
trainer endpoint and the servers, remote servers to the trainer endpoint; listeners are started for
the check). Prints one row per host and
returns the failures as "host: check: detail" lines (empty when all pass).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from prl.backends import registry
from prl.envs import env_class
from prl.inference.kv_master import MOONCAKE_PROBE
from prl.launch.hosts import Host, HostError, SshHost, SshTarget
from prl.launch.placement import Link
from prl.recipe.schema import ClusterCfg, HostCfg

CHECKS = ("reachable", "python", "disk", "gpus", "port", "model", "mooncake", "reach")  # + backend packages


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
    a port in TIME_WAIT is free for them); a taken one is named with the process holding it, where
    `ss` can tell."""
    code = ("import socket, sys\nbusy = []\n"
            f"for p in {sorted(set(ports))!r}:\n"
            "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"    try: s.bind(({h.address!r}, p))\n"
            "    except OSError: busy.append(p)\n"
            "    s.close()\n"
            "print(' '.join(map(str, busy))); sys.exit(1 if busy else 0)")
    r = host.run(_py(cfg, code))
    listed = ",".join(map(str, sorted(set(ports))))
    if r.code == 0:
        return Check("port", True, f"{listed} free")
    busy = r.stdout.split()
    if not busy:
        return Check("port", False, f"could not check ports {listed}: {r.stderr.strip()[-200:]}")
    return Check("port", False, "in use: " + ", ".join(f"{h.address}:{p}{holder_on(host, p)}" for p in busy))


def holder_on(host: Host, port: str) -> str:
    """' by pid N (name)' for the process listening on `port` on `host`, as `ss -ltnp` shows it; ''
    where it cannot be told (no `ss`, another user's process)."""
    r = host.run(f"ss -ltnpH 'sport = :{int(port)}' 2>/dev/null")
    m = re.search(r'users:\(\("([^"]+)",pid=(\d+)', r.stdout)
    return f" by pid {m.group(2)} ({m.group(1)})" if m else ""


def reach_check(host: Host, links: list[Link], cfg: ClusterCfg) -> Check:
    targets = sorted({(ln.address, ln.port) for ln in links})
    code = ("import socket\nbad = []\n"
            f"for a, p in {targets!r}:\n"
            "    try: socket.create_connection((a, p), 5).close()\n"
            "    except OSError: bad.append(f'{a}:{p}')\n"
            "print(' '.join(bad))")
    r = host.run(_py(cfg, code))
    where = ", ".join(f"{a}:{p}" for a, p in targets)
    if r.code == 0 and not r.stdout.strip():
        return Check("reach", True, f"reaches {where}")
    return Check("reach", False, f"cannot reach {r.stdout.strip() or where} (firewall? wrong address?)")


def listener(cfg: ClusterCfg, address: str, ports: list[int]) -> list[str]:
    """A process listening on `address` at every port in `ports` for a minute, accepting and closing."""
    code = ("import select, socket, time\nsocks = []\n"
            f"for p in {sorted(set(ports))!r}:\n"
            "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"    s.bind(({address!r}, p)); s.listen(64); socks.append(s)\n"
            "end = time.time() + 60\n"
            "while time.time() < end:\n"
            "    for s in select.select(socks, [], [], 1)[0]: s.accept()[0].close()")
    return [cfg.python, "-c", code]


def role_needs(recipe) -> dict[str, list[str]]:
    """What each host's roles need beyond Python: the pretrained folder (trainer and inference hosts
    read `model.path` in place), the backend's packages on inference hosts (its spec's `host_packages`:
    vLLM for `backend = "vllm"`) and Mooncake (the KV
    pool's hosts) and a working sandbox (an environment that needs it: the sandbox workers' hosts)."""
    p = recipe.placement_or_default()
    needs: dict[str, list[str]] = {}
    if env_class(recipe.env.kind).needs_sandbox:
        for h in p.sandbox or p.inference:
            needs.setdefault(h, []).append(f"sandbox:{recipe.env.sandbox.isolation}")
    if recipe.model.path:
        for h in dict.fromkeys([*p.trainer, *p.inference]):
            needs.setdefault(h, []).append("model")
        if recipe.inference.mtp_tokens:  # the servers draft with the folder's MTP layer
            for h in p.inference:
                needs[h].append("mtp")
    for package in registry.get(recipe.inference.backend).host_packages:
        for h in p.inference:
            needs.setdefault(h, []).append(package)
    if recipe.inference.kv_pool.enabled:  # the master and every server's store client
        for h in dict.fromkeys([*p.inference, recipe.inference.kv_pool.host or p.inference[0]]):
            needs.setdefault(h, []).append("mooncake")
    return needs


def model_check(host: Host, path: str) -> Check:
    q = shlex.quote(path)
    r = host.run(f"test -f {q}/config.json && {{ test -f {q}/model.safetensors || "
                 f"test -f {q}/model.safetensors.index.json; }}")
    return Check("model", r.code == 0, f"{path} has config and weights" if r.code == 0 else
                 f"model.path {path}: no config.json and safetensors weights on this host (the folder must "
                 f"exist at the same path on every trainer and inference host)")


def mtp_check(host: Host, cfg: ClusterCfg, path: str) -> Check:
    """`inference.mtp_tokens`: the host's copy of the folder has the MTP layer(s) its config declares."""
    code = (f"from prl.model.pretrained import check_pretrained; i = check_pretrained({path!r}); "
            "print(i.draft_layers, list(i.missing_draft))")
    try:
        r = host.run(_py(cfg, code), timeout=120)
    except (HostError, subprocess.TimeoutExpired) as e:
        return Check("model", False, f"could not read {path}'s MTP layers: {e}")
    if r.code != 0:
        return Check("model", False, f"model.path {path}: unreadable ({last_line(r)[:200]})")
    layers, _, missing = r.stdout.strip().partition(" ")
    if layers != "0":
        return Check("model", True, f"{path} has {layers} MTP layer(s) for inference.mtp_tokens")
    return Check("model", False, f"inference.mtp_tokens: {path} has no MTP layer on this host (config.json's "
                                 f"num_nextn_predict_layers is 0 or absent; missing layers {missing}); use mtp_tokens = 0")


def package_check(host: Host, cfg: ClusterCfg, name: str, extra: str, why: str, code: str | None = None,
                  libs: tuple[str, ...] = ()) -> Check:
    """`name` importable by the hosts' Python (or `code` runs), or installed by provisioning; `libs`:
    system libraries it links, which provisioning does not install (checked either way)."""
    missing = [lib for lib in libs if host.run(f"ldconfig -p | grep -q {shlex.quote(lib)}").code != 0]
    apt = f"; the host lacks {', '.join(missing)} (apt-get install {' '.join(lib_package(m) for m in missing)})" if missing else ""
    if extra in cfg.extras:
        return Check(name, not missing, f"installed by provisioning (cluster.extras){apt}")
    try:
        r = host.run(_py(cfg, code or f"import {name}; print(getattr({name}, '__version__', 'importable'))"), timeout=180)
    except (HostError, subprocess.TimeoutExpired) as e:
        return Check(name, False, f"{cfg.python} could not be asked about {name} ({why}): {e}")
    if r.code == 0 and not missing:
        return Check(name, True, r.stdout.strip() if code else f"{name} {r.stdout.strip()}")
    return Check(name, False, f"{cfg.python} cannot {'run' if code else 'import'} {name} ({why}): {last_line(r)[:200]}{apt}; "
                              f"install it in the host image or add '{extra}' to cluster.extras")


def sandbox_check(host: Host, cfg: ClusterCfg, isolation: str) -> Check:
    """The host's prl runs a program in its sandbox with the recipe's isolation (bubblewrap,
    namespaces, root to switch uid)."""
    code = (f"from prl.sandbox import run; r = run('print(6 * 7)', isolation={isolation!r}, timeout_s=30); "
            "assert r.stdout.strip() == '42', r; print(f'runs programs ({r.isolation}, {r.wall_s:.2f}s)')")
    try:
        r = host.run(_py(cfg, code), timeout=120)
    except (HostError, subprocess.TimeoutExpired) as e:
        return Check("sandbox", False, f"could not try the sandbox: {e}")
    if r.code == 0:
        return Check("sandbox", True, r.stdout.strip())
    return Check("sandbox", False, f"model-written code cannot run here (env.sandbox.isolation = {isolation!r}): "
                                   f"{last_line(r)[:300]}; install bubblewrap (apt-get install bubblewrap), run prl as "
                                   f"root, or place the sandbox elsewhere (placement.sandbox)")


def last_line(r) -> str:
    """The last line a failed remote command wrote (stderr first): usually the exception."""
    return ((r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or ["no output"])[0]


def lib_package(soname: str) -> str:
    """The Debian package of a shared library prl checks for."""
    return {"libibverbs.so.1": "libibverbs1"}.get(soname, soname)


def check_cluster(cfg: ClusterCfg, console: Console, ports: dict[str, list[int]] | None = None,
                  links: list[Link] | None = None, hosts: dict[str, Host] | None = None,
                  needs: dict[str, list[str]] | None = None, model_path: str | None = None) -> dict[str, list[Check]]:
    """`ports`: host name -> ports the plan binds there; `links`: connections the plan makes;
    `hosts`: open connections to reuse (the caller keeps and closes them), else opened and closed here;
    `needs`: host name -> what its roles need (`role_needs`)."""
    by_id = cfg.hosts_by_id()
    owned = hosts is None
    hosts = {hid: connect(cfg, h) for hid, h in by_id.items()} if owned else {hid: hosts[hid] for hid in by_id}
    results: dict[str, list[Check]] = {}
    with Progress(console=console, transient=True) as progress, ThreadPoolExecutor(len(hosts)) as pool:
        task = progress.add_task("checking hosts", total=len(hosts) + 1)
        futures = {a: pool.submit(host_checks, hosts[a], by_id[a], cfg, (ports or {}).get(a), (needs or {}).get(a, []),
                                  model_path) for a in hosts}
        for a, f in futures.items():
            results[a] = f.result()
            progress.advance(task)
        reach_phase(cfg, hosts, results, pool, links or [])
        progress.advance(task)
    if owned:
        for host in hosts.values():
            host.close()
    return results


def host_checks(host: Host, h: HostCfg, cfg: ClusterCfg, ports: list[int] | None, needs: list[str] = (),
                model_path: str | None = None) -> list[Check]:
    out = basic_checks(host, h, cfg)
    if not out[0].ok:
        return out
    if ports:
        out.append(port_check(host, h, cfg, ports))
    if "model" in needs and model_path:
        out.append(model_check(host, model_path))
        if "mtp" in needs and out[-1].ok:
            out.append(mtp_check(host, cfg, model_path))
    for name, extra in (n for n in needs if isinstance(n, tuple)):  # the backend's packages
        out.append(package_check(host, cfg, name, extra, "inference.backend"))
    for iso in (n.partition(":")[2] for n in needs if isinstance(n, str) and n.startswith("sandbox:")):
        out.append(sandbox_check(host, cfg, iso))
    if "mooncake" in needs:
        out.append(package_check(host, cfg, "mooncake", "mooncake", "inference.kv_pool", code=MOONCAKE_PROBE,
                                 libs=("libibverbs.so.1",)))
    return out


def reach_phase(cfg: ClusterCfg, hosts: dict[str, Host], results: dict[str, list[Check]], pool,
                links: list[Link]) -> None:
    """Listeners on every planned (address, port) of healthy hosts; each host connects to its targets."""
    healthy = {a for a, checks in results.items() if all(c.ok for c in checks if c.name in ("reachable", "port"))}
    links = [ln for ln in links if ln.src in healthy and ln.dst in healthy]
    listening = {}
    try:
        for dst in sorted({ln.dst for ln in links}):
            mine = [ln for ln in links if ln.dst == dst]
            listening[dst] = hosts[dst].start(listener(cfg, mine[0].address, [ln.port for ln in mine]),
                                              f"{cfg.workdir_of(cfg.hosts_by_id()[dst])}/doctor-listener.log")
        time.sleep(0.5 if listening else 0)  # the listeners bind
        sources = sorted({ln.src for ln in links})
        checks = pool.map(lambda a: reach_check(hosts[a], [ln for ln in links if ln.src == a], cfg), sources)
        for a, check in zip(sources, checks):
            results[a].append(check)
    finally:
        for dst, pid in listening.items():
            hosts[dst].stop(pid, grace_s=1.0)


def report(results: dict[str, list[Check]], console: Console) -> list[str]:
    table = Table(title="prl doctor", title_justify="left")
    table.add_column("host")
    seen = {c.name for checks in results.values() for c in checks}
    ran = [n for n in CHECKS if n in seen] + sorted(seen - set(CHECKS))  # only the checks this recipe needs
    for name in ran:
        table.add_column(name)
    failures = []
    for address, checks in results.items():
        by_name = {c.name: c for c in checks}
        cells = []
        for name in ran:
            c = by_name.get(name)
            cells.append("-" if c is None else f"[green]ok[/] {c.detail}" if c.ok else f"[red]FAIL[/] {c.detail}")
        table.add_row(address, *cells)
        failures += [f"{address}: {c.name}: {c.detail}" for c in checks if not c.ok]
    console.print(table)
    return failures


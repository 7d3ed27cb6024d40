"""Launching a recipe with [cluster]: check, provision, stage, then hand a Supervisor to the driver.

Order (each step fails before the next starts anything): connect and run the `prl doctor`
checks plus the ports this plan needs; build and install the wheel on every host (parallel);
copy each host the run files its processes need (model folder, configs, secret; parallel);
return the plan's processes bound to their hosts. Nothing is shared between hosts.
"""

from __future__ import annotations

import io
import shlex
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console

from prl.launch.doctor import check_cluster, connect, report, role_needs
from prl.launch.hosts import Host, HostError, LocalHost
from prl.launch.placement import links_needed, ports_needed
from prl.launch.processes import ProcessSpec, make_plan
from prl.launch.provision import provision, venv_dir
from prl.launch.configs import resolve
from prl.launch.supervisor import Supervisor
from prl.recipe.resolve import WORKSTATION, ProcessConfig, write_configs, write_secret
from prl.recipe.schema import Recipe


class LaunchError(RuntimeError):
    """A cluster run could not start; nothing is left running. The message names hosts and checks."""


def connect_all(recipe: Recipe) -> dict[str, Host]:
    hosts: dict[str, Host] = {h.id: connect(recipe.cluster, h) for h in recipe.cluster.hosts}
    hosts[WORKSTATION] = LocalHost(WORKSTATION)
    return hosts


def preflight(recipe: Recipe, configs: list[ProcessConfig], hosts: dict[str, Host], console: Console) -> None:
    results = check_cluster(recipe.cluster, console, ports_needed(configs, recipe), links_needed(configs, recipe),
                            hosts, needs=role_needs(recipe), model_path=recipe.model.path)
    failures = report(results, console)
    if failures:
        raise LaunchError("host checks failed, nothing was started:\n  " + "\n  ".join(failures))


def bundle(run_dir: Path, names: list[str]) -> bytes:
    """The run files one host needs: model folder, recipe, secret, and its processes' configs."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for item in ("model", "recipe.json", "secret"):
            tar.add(run_dir / item, arcname=item)
        for name in names:
            tar.add(run_dir / "config" / f"{name}.json", arcname=f"config/{name}.json")
    return buf.getvalue()


def stage(host: Host, run_dir: Path, remote_dir: str, names: list[str], resume: bool = False,
          shared: str | None = None) -> None:
    """Copy and unpack the host's run files. A new run starts from an empty directory; a resumed
    one keeps only `checkpoints/` (logs and metrics were streamed to the workstation already, and
    weight versions are republished from the checkpoint). With `shared` (a trainer host of a run with
    `cluster.shared_checkpoints`), `checkpoints` links to that folder (emptied for a new run)."""
    archive = run_dir / "staging" / f"{host.name.replace('/', '_')}.tar.gz"
    archive.parent.mkdir(exist_ok=True)
    archive.write_bytes(bundle(run_dir, names))
    remote_tar = f"{remote_dir}.stage.tar.gz"
    try:
        host.put(archive, remote_tar)
    finally:
        archive.unlink()
    q = shlex.quote
    clear = (f"mkdir -p {q(remote_dir)} && find {q(remote_dir)} -mindepth 1 -maxdepth 1 ! -name checkpoints "
             f"-exec rm -rf {{}} +" if resume else f"rm -rf {q(remote_dir)} && mkdir -p {q(remote_dir)}")
    link = f" && {link_checkpoints(remote_dir + '/checkpoints', shared, resume)}" if shared else ""
    r = host.run(f"{clear} && tar -xzf {q(remote_tar)} -C {q(remote_dir)} && rm -f {q(remote_tar)}{link}",
                 timeout=3600 if link else 60)  # adopting checkpoints into the shared folder copies them
    if r.code:
        raise HostError(f"{host.name}: could not unpack the run files into {remote_dir}: {r.stderr.strip()}")


def link_checkpoints(local: str, shared: str, resume: bool) -> str:
    """The shell that makes `local` (a trainer host's `checkpoints`) a link to `shared`. A new run
    empties `shared`; a resumed one whose `local` is still a folder of its own (the run turned
    `cluster.shared_checkpoints` on) first adopts its checkpoints one by one: a step `shared` lacks is
    copied under a temporary name and renamed in (a copy cut short never looks sealed), a step it
    has is kept; the local folder goes only once every step is in."""
    q = shlex.quote
    fresh = "" if resume else f"rm -rf {q(shared)} && "
    adopt = (f'if [ -d {q(local)} ] && [ ! -L {q(local)} ]; then '
             f'for d in {q(local)}/*/; do [ -d "$d" ] || continue; n=$(basename "$d"); '
             f'[ -e {q(shared)}/"$n" ] && continue; '
             f'rm -rf {q(shared)}/".adopt-$n" && cp -a "$d" {q(shared)}/".adopt-$n" '
             f'&& mv {q(shared)}/".adopt-$n" {q(shared)}/"$n" || exit 1; done; rm -rf {q(local)}; fi')
    return f"{fresh}mkdir -p {q(shared)} && {adopt} && ln -sfn {q(shared)} {q(local)}"


def write_local(configs: list[ProcessConfig], run_dir: Path) -> None:
    write_secret(run_dir)
    write_configs(configs, run_dir)


def check_resumable(recipe: Recipe, configs: list[ProcessConfig], hosts: dict[str, Host]) -> None:
    """A resumed cluster run needs a sealed checkpoint on the first trainer host (rank 0 reads it)."""
    rank0 = next(c for c in configs if c.role == "trainer" and c.index == 0)
    r = hosts[rank0.node].run(f"ls {shlex.quote(rank0.run_dir)}/checkpoints/*/MANIFEST.json 2>/dev/null")
    if not r.stdout.strip():
        raise LaunchError(f"cannot resume: no sealed checkpoint in {rank0.run_dir}/checkpoints on host {rank0.node} "
                          f"(the first trainer host); nothing was started")


def stage_all(recipe: Recipe, configs: list[ProcessConfig], hosts: dict[str, Host], run_dir: Path, pool,
              resume: bool) -> None:
    """Stage every remote (host, run directory) with the configs of the processes placed there."""
    places = dict.fromkeys((c.node, c.run_dir) for c in configs if c.node != WORKSTATION)
    shared = shared_checkpoint_dir(recipe)
    trainers = {(c.node, c.run_dir) for c in configs if c.role == "trainer"}
    jobs = [pool.submit(stage, hosts[n], run_dir, d, [c.name for c in configs if (c.node, c.run_dir) == (n, d)],
                        resume, shared if (n, d) in trainers else None) for n, d in places]
    for f in jobs:
        f.result()


def shared_checkpoint_dir(recipe: Recipe) -> str | None:
    """This run's folder under `cluster.shared_checkpoints`, or None."""
    root = recipe.shared_checkpoints()
    return f"{root.rstrip('/')}/{recipe.run.name}" if root else None


def python_for(recipe: Recipe, key: str):
    """node -> the interpreter its processes run with: the run's venv on a host, ours on the workstation."""
    by_id = recipe.cluster.hosts_by_id()
    return lambda node: sys.executable if node == WORKSTATION else f"{venv_dir(recipe.cluster, by_id[node], key)}/bin/python"


def launch(recipe: Recipe, run_dir: Path, console: Console, resume: bool = False) -> Supervisor:
    configs = resolve(recipe, run_dir)
    hosts = connect_all(recipe)
    pool = ThreadPoolExecutor(max(4, len(hosts)))
    try:
        preflight(recipe, configs, hosts, console)
        if resume:
            check_resumable(recipe, configs, hosts)
        console.print(f"prl run: provisioning {len(recipe.cluster.hosts)} host(s)", markup=False)
        done, key = provision(hosts, recipe.cluster, pool)
        console.print("prl run: " + ", ".join(f"{p.host} {p.state} {p.seconds:.1f}s" for p in done.values()),
                      markup=False)
        write_local(configs, run_dir)
        stage_all(recipe, configs, hosts, run_dir, pool, resume)
    except Exception:
        for h in hosts.values():
            h.close()
        raise
    finally:
        pool.shutdown()
    specs = make_plan(configs, run_dir, python_for(recipe, key))
    return Supervisor(specs, hosts, run_dir, heartbeat_s=recipe.cluster.heartbeat_timeout_s)


def dry_run_plan(recipe: Recipe, run_dir: Path) -> list[ProcessSpec]:
    return make_plan(resolve(recipe, run_dir), run_dir, python_for(recipe, "<wheel-key>"))

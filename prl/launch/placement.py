"""Placement for a multi-host recipe: a recipe with [cluster] (+ [placement]) -> one config per process.

Rules (the local counterpart is `prl.recipe.resolve.resolve`):
- one torchrun per trainer host, `trainer.nproc` ranks each; rank 0 (node rank 0, the first
  trainer host) runs the trainer endpoint on `cluster.trainer_port` and the torch rendezvous;
- per inference host, `gpus // gpus_per_server` servers (one on a CPU host), ports counting up
  from `cluster.inference_port`, each bound to its host's address;
- the orchestrator runs on `placement.orchestrator`, default the first trainer host;
- each host keeps the run's files in `{workdir}/runs/{run.name}`; nothing is shared between hosts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prl.recipe.resolve import ProcessConfig, attach_kv_master
from prl.recipe.schema import HostCfg, PlacementCfg, Recipe

WORKSTATION = "workstation"


def host_run_dir(recipe: Recipe, h: HostCfg) -> str:
    return f"{recipe.cluster.workdir_of(h)}/runs/{recipe.run.name}"


def servers_on(h: HostCfg, p: PlacementCfg) -> int:
    return max(1, h.gpus // p.gpus_per_server)


def resolve_cluster(recipe: Recipe, local_run_dir: Path) -> list[ProcessConfig]:
    cluster, p = recipe.cluster, recipe.placement_or_default()
    hosts = {h.id: h for h in cluster.hosts}
    trainers = [hosts[n] for n in p.trainer]
    first = trainers[0]
    world = recipe.trainer.nproc * len(trainers)
    trainer_url = f"http://{first.address}:{cluster.trainer_port}"

    def on(h: HostCfg | None, **kw) -> ProcessConfig:
        run_dir = str(local_run_dir) if h is None else host_run_dir(recipe, h)
        return ProcessConfig(recipe=recipe, run_dir=run_dir, secret_file=f"{run_dir}/secret",
                             node=WORKSTATION if h is None else h.id, trainer_url=trainer_url,
                             trainer_world=world, **kw)

    servers = []
    for h in (hosts[n] for n in p.inference):
        for k in range(servers_on(h, p)):
            i = len(servers)
            servers.append(on(h, name=f"inference-{i}", role="inference", host=h.address,
                              port=cluster.inference_port + k, index=i, shares_trainer_fs=h is first,
                              gpus=list(range(k * p.gpus_per_server, (k + 1) * p.gpus_per_server)) if h.gpus else []))
    orch_host = first if p.orchestrator is None else None if p.orchestrator == WORKSTATION else hosts[p.orchestrator]
    orchestrator = on(orch_host, name="orchestrator", role="orchestrator",
                      servers=[f"http://{s.host}:{s.port}" for s in servers],
                      prefill_servers=[s.index for s in servers if s.node in set(p.prefill)])
    ranks = [on(h, name="trainer" if len(trainers) == 1 else f"trainer-{i}", role="trainer", host=h.address,
                port=cluster.trainer_port, index=i) for i, h in enumerate(trainers)]
    return [*kv_master_on(recipe, hosts[recipe.inference.kv_pool.host or p.inference[0]], on, servers),
            *servers, orchestrator, *ranks]


def kv_master_on(recipe: Recipe, h: HostCfg, on, servers: list[ProcessConfig]) -> list[ProcessConfig]:
    """With `inference.kv_pool`: the `kv-master` on `h` (ports from kv_pool.port, default 50051, +1
    metadata, +2 metrics), its address told to every server."""
    pool = recipe.inference.kv_pool
    if not pool.enabled:
        return []
    rpc = pool.port or 50051
    addr = attach_kv_master(h.address, (rpc, rpc + 1, rpc + 2), servers)
    return [on(h, name="kv-master", role="kv_master", host=h.address, port=rpc, kv_master=addr)]


def ports_needed(configs: list[ProcessConfig], recipe: Recipe) -> dict[str, list[int]]:
    """Ports each host must have free: servers, the trainer endpoint, and the rendezvous."""
    out: dict[str, list[int]] = {}
    for c in configs:
        if c.role == "inference" or (c.role == "trainer" and c.index == 0):
            out.setdefault(c.node, []).append(c.port)
        if c.role == "trainer" and c.index == 0:
            out[c.node].append(recipe.cluster.rendezvous_port)
        if c.role == "kv_master":
            out.setdefault(c.node, []).extend(c.kv_master[k] for k in ("rpc_port", "metadata_port", "metrics_port"))
    return out


@dataclass(frozen=True)
class Link:
    """A connection the run will make: from host `src` to `address:port`, listened on by host `dst`."""

    src: str
    dst: str
    address: str
    port: int


def links_needed(configs: list[ProcessConfig], recipe: Recipe) -> list[Link]:
    """Trainer ranks -> rendezvous; orchestrator -> trainer endpoint and every server; servers on other
    hosts than rank 0 -> trainer endpoint (weight downloads). The workstation is not checked."""
    rank0 = next(c for c in configs if c.role == "trainer" and c.index == 0)
    orch = next(c for c in configs if c.role == "orchestrator")
    endpoint = (rank0.node, rank0.host, rank0.port)
    links = [Link(c.node, rank0.node, rank0.host, recipe.cluster.rendezvous_port)
             for c in configs if c.role == "trainer" and c.index > 0]
    links.append(Link(orch.node, *endpoint))
    links += [Link(orch.node, s.node, s.host, s.port) for s in configs if s.role == "inference"]
    links += [Link(s.node, *endpoint) for s in configs if s.role == "inference" and not s.shares_trainer_fs]
    for m in (c for c in configs if c.role == "kv_master"):  # servers -> the pool's master and metadata
        links += [Link(s.node, m.node, m.host, m.kv_master[k]) for s in configs if s.role == "inference"
                  for k in ("rpc_port", "metadata_port")]
    return [ln for ln in dict.fromkeys(links) if WORKSTATION not in (ln.src, ln.dst)]

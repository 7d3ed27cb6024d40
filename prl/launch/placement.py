"""What a cluster plan needs from the network, for `prl doctor` and the launch preflight: the ports
each host must have free and the connections the run will make. The plan itself (who runs where, on
which port) is `prl.recipe.resolve.resolve`, for one machine and a cluster alike."""

from __future__ import annotations

from dataclasses import dataclass

from prl.recipe.resolve import WORKSTATION, ProcessConfig
from prl.recipe.schema import Recipe


def ports_needed(configs: list[ProcessConfig], recipe: Recipe) -> dict[str, list[int]]:
    """Ports each host must have free: servers, sandbox workers, the trainer endpoint, and the rendezvous."""
    out: dict[str, list[int]] = {}
    for c in configs:
        if c.role in ("inference", "sandbox") or (c.role == "trainer" and c.index == 0):
            out.setdefault(c.node, []).append(c.port)
        if c.role == "trainer" and c.index == 0:
            out[c.node].append(recipe.cluster.rendezvous_port)
        if c.role == "inference" and c.engine_rpc:  # a multi-host engine's data-parallel RPC, on its leader
            out[c.node].append(c.engine_rpc_address()[1])
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
    """Trainer ranks -> rendezvous; orchestrator -> trainer endpoint, every server and sandbox worker; servers on other
    hosts than rank 0 -> trainer endpoint (weight downloads). The workstation is not checked."""
    rank0 = next(c for c in configs if c.role == "trainer" and c.index == 0)
    orch = next(c for c in configs if c.role == "orchestrator")
    endpoint = (rank0.node, rank0.host, rank0.port)
    links = [Link(c.node, rank0.node, rank0.host, recipe.cluster.rendezvous_port)
             for c in configs if c.role == "trainer" and c.index > 0]
    links.append(Link(orch.node, *endpoint))
    links += [Link(orch.node, s.node, s.host, s.port) for s in configs if s.role in ("inference", "sandbox")]
    links += [Link(s.node, *endpoint) for s in configs if s.role in ("inference", "engine_worker") and not s.shares_trainer_fs]
    leaders = {c.name: c for c in configs if c.role == "inference"}
    for w in (c for c in configs if c.role == "engine_worker"):  # engine workers -> their leader's RPC
        lead = leaders[w.engine]
        links.append(Link(w.node, lead.node, *lead.engine_rpc_address()))
    for m in (c for c in configs if c.role == "kv_master"):  # servers -> the pool's master and metadata
        links += [Link(s.node, m.node, m.host, m.kv_master[k]) for s in configs
                  if s.role in ("inference", "engine_worker") for k in ("rpc_port", "metadata_port")]
    return [ln for ln in dict.fromkeys(links) if WORKSTATION not in (ln.src, ln.dst)]

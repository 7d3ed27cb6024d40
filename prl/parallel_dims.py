"""The trainer's parallel layout: every dimension by name, the rank arithmetic, the device meshes.

As torchtitan's `ParallelDims`, one object owns it, and nothing else computes a data-parallel rank:
- `dp_shard` x `cp` = world (`dp_replicate` and `tp` are named, and must be 1 until they are built).
  Ranks are laid out row-major over (dp_replicate, dp_shard, cp, tp): the `cp` ranks of a
  data-parallel rank are consecutive and split its rows (each computes a slice of the same
  micro-batches); `ep` borrows `ep` consecutive ranks of the same world for the experts.
- FSDP shards every parameter over dp_replicate x dp_shard x cp (torchtitan's `dp_shard_cp`) and
  averages gradients over those ranks: `grad_divisor`.
- `shard_layout(t)` says how one tensor is split (which tensor dim, which mesh dim, which ranks in
  shard order): publishing and sharded loading read it instead of assuming dim 0.

The arithmetic imports no torch (the orchestrator and the recipe resolver ask it for the
data-parallel size); meshes are built by `build_meshes`, which imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class ParallelDims:
    world: int
    dp_shard: int
    cp: int = 1
    ep: int = 1
    tp: int = 1  # tensor parallelism: not built yet
    dp_replicate: int = 1  # HSDP replicas: not built yet
    _meshes: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        for name in ("tp", "dp_replicate"):
            if getattr(self, name) != 1:
                raise NotImplementedError(f"trainer.parallel.{name} = {getattr(self, name)}: not built yet")

    @classmethod
    def of(cls, world: int, dp_shard: int = -1, cp: int = 1, ep: int = 1) -> "ParallelDims":
        """The layout at `world` ranks; `dp_shard` -1: what the other dimensions leave. Not
        validated: `ParallelCfg.check` names what is wrong with the recipe's values."""
        return cls(world, dp_shard if dp_shard != -1 else world // cp, cp, ep)

    # ---- rank arithmetic (torch-free)
    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each takes its own micro-batches (the orchestrator packs for these)."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """Which micro-batches global rank `rank` (with its CP and TP peers) takes."""
        return rank // (self.cp * self.tp)

    @property
    def grad_divisor(self) -> int:
        """The ranks FSDP averages gradients over: a loss normalised over the whole step is scaled by
        it, and expert gradients (outside FSDP) are divided by it."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    # ---- device meshes (torch)
    def build_meshes(self, device_type: str) -> "ParallelDims":
        """Create the device meshes, in the same order on every rank (each creates process groups):
        `fsdp` ("dp_shard": every rank), `ep` ("ep_replica", "ep") and `cp` ("dp", "cp") where enabled."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        if self._meshes:
            return self
        ranks = torch.arange(self.world)
        self._meshes["fsdp"] = DeviceMesh(device_type, ranks, mesh_dim_names=("dp_shard",))
        if self.ep_enabled:
            self._meshes["ep"] = DeviceMesh(device_type, ranks.view(self.world // self.ep, self.ep),
                                            mesh_dim_names=("ep_replica", "ep"))
        if self.cp_enabled:
            self._meshes["cp"] = DeviceMesh(device_type, ranks.view(self.world // self.cp, self.cp),
                                            mesh_dim_names=("dp", "cp"))
        return self

    def mesh(self, name: str):
        """A built mesh by name ("fsdp", "ep", "cp")."""
        if name not in self._meshes:
            raise KeyError(f"no {name!r} mesh: " + ("call build_meshes first" if not self._meshes else
                                                     f"the layout has {sorted(self._meshes)} ({self})"))
        return self._meshes[name]


@dataclass(frozen=True)
class ShardLayout:
    """How one tensor is split: along `tensor_dim`, over mesh dimension `mesh_dim`; shard k is held
    by global rank `ranks[k]` (torch.chunk sizes: `per` each, the last shorter or empty). `index`:
    this rank's shard; `group`: the process group of `ranks`."""

    tensor_dim: int
    mesh_dim: int
    ranks: tuple[int, ...]
    index: int
    length: int  # the tensor's size along tensor_dim
    group: object = None

    @property
    def per(self) -> int:
        return math.ceil(self.length / len(self.ranks))

    def bounds(self, k: int) -> tuple[int, int]:
        """[start, stop) along `tensor_dim` of shard k."""
        start = min(k * self.per, self.length)
        return start, min(start + self.per, self.length)

    @property
    def mine(self) -> tuple[int, int]:
        return self.bounds(self.index)


def shard_layout(t) -> ShardLayout | None:
    """The layout of a DTensor sharded over one mesh dimension; None for a tensor whole on every rank."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None
    shards = [(i, p) for i, p in enumerate(t.placements) if p.is_shard()]
    if not shards:
        return None
    if len(shards) > 1:
        raise NotImplementedError(f"a tensor sharded as {t.placements}: prl handles one sharded mesh dimension")
    mesh_dim, placement = shards[0]
    group = t.device_mesh.get_group(mesh_dim)
    return ShardLayout(placement.dim, mesh_dim, tuple(dist.get_process_group_ranks(group)),
                       t.device_mesh.get_local_rank(mesh_dim), t.shape[placement.dim], group)

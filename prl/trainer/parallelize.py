"""Apply parallelism to a plain Hugging Face model; the model file stays untouched.

The trainer's ranks form named dimensions (`[trainer.parallel]`), owned with their meshes by
`prl.parallel_dims.ParallelDims`: `dp_shard` x `cp` = world, and `ep` borrowed from them for the
experts. Features are applied in torchtitan's order, each by its own function: expert parallelism
(experts split over `ep`), context parallelism (GLM-5's DSA attention over `cp`), the
chunked-logprob head, the lean forward (`prl.trainer.lean`), activation checkpointing, then FSDP2 (each decoder layer its own unit, then
the root) with mixed precision (`trainer.dtype` compute, fp32 weights, reductions and optimizer
state). FSDP2 is applied even with one rank so the code path is the same on 1 and N ranks.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from prl.model.build import torch_dtype
from prl.parallel_dims import ParallelDims, shard_layout
from prl.recipe.schema import TrainerCfg
from prl.trainer import context_parallel, head, lean
from prl.trainer.expert_parallel import reduce_expert_grads, shard_experts


def decoder_layers(model) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise NotImplementedError(f"{type(model).__name__}: prl expects decoder layers at model.model.layers")
    return list(layers)


class Parallel:
    """The model as the trainer holds it, and what its parallel layout needs after backward."""

    def __init__(self, model, dims: ParallelDims, tcfg: TrainerCfg):
        """`dims` with its meshes built (`ParallelDims.build_meshes`)."""
        self.dims = dims
        self.expert_params = shard_ep(model, dims, tcfg) if dims.ep_enabled else []
        self.seq = None  # the context-parallel row state, with cp > 1
        if dims.cp_enabled:
            cp_dim = dims.mesh("cp")["cp"]
            self.seq = context_parallel.install(model, cp_dim.get_group(), cp_dim.size(), cp_dim.get_local_rank(),
                                                tcfg.parallel.cp_layout, tcfg.parallel.overlap)
        head.install(model)
        # the forward through the model's own modules (`prl.trainer.lean`); where it does not fit, the model's
        two_batch = tcfg.parallel.overlap_parts if tcfg.parallel.overlap == "two_batch" and dims.ep_enabled else 0
        self.lean = tcfg.lean_forward and lean.install(model, cp=self.seq is not None, parts=two_batch)
        if two_batch and not self.lean:
            raise ValueError(f"trainer.parallel.overlap = 'two_batch' runs through prl's lean forward, which does not "
                             f"fit this {model.config.model_type} model (a family without one, sliding windows, or "
                             f"an attention other than sdpa or eager): use overlap = true")
        if tcfg.activation_checkpointing:
            apply_activation_checkpointing(model)
        self.model = apply_fsdp(model, dims.mesh("fsdp"), torch_dtype(tcfg.dtype), set(self.expert_params))

    def finish_grads(self) -> None:
        """After backward, before the norm: expert gradients averaged as FSDP averaged the rest."""
        if self.expert_params:
            reduce_expert_grads(self.expert_params, self.dims.mesh("ep")["ep_replica"], self.dims.grad_divisor)

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grad_norm(list(self.model.parameters()), max_norm)


def shard_ep(model, dims: ParallelDims, tcfg: TrainerCfg) -> list[torch.nn.Parameter]:
    """Expert parallelism with the recipe's dispatch: FP8 or not, node dedup or not, over nodes of
    `ep_ranks_per_node` ranks, else of the ranks torchrun started on this host."""
    par = tcfg.parallel
    per_node = par.ranks_per_node(dims.world, int(os.environ.get("LOCAL_WORLD_SIZE", dims.world)))
    return shard_experts(model, dims.mesh("ep"), per_node, par.ep_dispatch == "fp8", par.ep_node_dedup,
                         par.overlap_chunks if par.overlap else 1, par.overlap == "two_batch")


def apply_activation_checkpointing(model) -> None:
    """Each decoder layer recomputes its activations in backward (transformers' layers support it), the
    whole layer: torch's early stop would end the recomputation after its last saved tensor, before the
    MoE block takes the shared experts computed ahead (`expert_parallel.AheadShared`), leaving that
    result, and the recomputed graph under it, held until the layer's next forward."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "early_stop": False})


def apply_fsdp(model, mesh: DeviceMesh, dtype: torch.dtype, ignored: set) -> torch.nn.Module:
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, ignored_params=ignored & set(layer.parameters()) or None)
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=ignored or None)
    return model


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """The global gradient norm over parameters sharded on different meshes (FSDP's over every
    rank, the experts' over `ep`), then every gradient scaled by min(1, max_norm / norm). Each
    shard's squared norm is summed over the ranks that hold distinct parts of that parameter."""
    by_group: dict[object, torch.Tensor] = {}
    for p in params:  # grouped by the parameter's layout, so every rank reduces the same groups
        group = shard_group(p)
        g = p.grad
        local = torch.zeros(()) if g is None else (g.to_local() if isinstance(g, DTensor) else g)
        by_group[group] = by_group.get(group, 0) + local.detach().float().pow(2).sum()
    total = 0.0
    for group, sq in by_group.items():
        if group is not None:
            dist.all_reduce(sq, group=group)
        total += float(sq)
    norm = math.sqrt(total)
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def shard_group(g: torch.Tensor):
    """The process group over which a tensor's shards are distinct (None: whole on every rank)."""
    layout = shard_layout(g)
    return None if layout is None else layout.group

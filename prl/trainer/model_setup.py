"""The model as a trainer rank holds it: built, FP8-swapped, parallelized, its weights in place.

A pretrained folder is read shard by shard into a meta-built model: no rank ever holds the whole
model, with or without FP8 (`apply_fp8` swaps layer classes by their shapes only; the FP8 copies
are made per step from the sharded master weights, so it runs on the meta model as well). A folder
without weights (prl's own tiny configs) is built whole from its seed on every rank, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from prl.model.fp8 import apply_fp8
from prl.model.policy import FULL, FullPolicy
from prl.model.pretrained import has_weights
from prl.model.routing import Replay, routers
from prl.parallel_dims import ParallelDims
from prl.recipe.schema import TrainerCfg
from prl.trainer.parallelize import Parallel
from prl.trainer.sharded_load import load_sharded, meta_model


@dataclass
class TrainedModel:
    par: Parallel
    replay: Replay | None
    fp8: dict[str, list[str]] = field(default_factory=dict)  # apply_fp8's report; empty without FP8
    bytes_read: int | None = None  # this rank's shard bytes, when read from a pretrained folder


def setup_model(model_dir: str | Path, tcfg: TrainerCfg, dims: ParallelDims, device: torch.device,
                seed: int = 0, policy: FullPolicy = FULL) -> TrainedModel:
    """`dims` with its meshes built. Order: build (meta when sharded), router replay, FP8, what `policy` adds
    (LoRA: adapters, the base frozen; `prl.model.policy`), parallelize, then the sharded read into this rank's
    shards."""
    from prl.model.build import build_model

    sharded = has_weights(model_dir)
    model = meta_model(model_dir) if sharded else build_model(model_dir, seed=seed).to(device)
    replay = Replay(model, replay=tcfg.router_replay) if routers(model) else None
    report = apply_fp8(model) if tcfg.fp8 else {}
    policy.adapt(model, tcfg.dtype, seed)
    par = Parallel(model, dims, tcfg)
    read = None
    if sharded:
        par.model.to_empty(device=device)
        read = load_sharded(par.model, Path(model_dir))
        policy.after_load(par.model, seed)
    return TrainedModel(par, replay, report, read)


def setup_reference(model_dir: str | Path, tcfg: TrainerCfg, dims: ParallelDims, device: torch.device,
                    seed: int = 0):
    """The frozen reference policy of trainer.loss.kl_coef: built and parallelized as the policy (FSDP2, EP,
    CP, FP8), no gradients; its weights are loaded by the caller."""
    ref = setup_model(model_dir, tcfg, dims, device, seed=seed).par.model
    ref.requires_grad_(False)
    return ref

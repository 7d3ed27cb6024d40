"""Apply parallelism to a plain Hugging Face model; the model file stays untouched.

Order as in torchtitan: (activation checkpointing, compile: not yet) then FSDP2. Each decoder
layer is its own FSDP unit, then the root (embeddings, final norm, lm_head). FSDP2 is applied even
with one rank so the code path is the same on 1 and N ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard


def make_mesh(device: torch.device) -> DeviceMesh:
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))


def decoder_layers(model) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise NotImplementedError(f"{type(model).__name__}: prl expects decoder layers at model.model.layers")
    return list(layers)


def parallelize(model: torch.nn.Module, *, mesh: DeviceMesh) -> torch.nn.Module:
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model

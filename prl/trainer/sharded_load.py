"""Pretrained weights into a sharded trainer without any rank holding the whole model.

The model is built on the meta device (no memory), parallelized (experts split, FSDP2 shards),
materialised empty on the rank's device, and each rank then reads from the safetensors files only
the rows of each tensor it owns, straight into its shard, as its `prl.parallel_dims.shard_layout`
says: every prl shard is a dim-0 range today (FSDP2 and expert parallelism both shard dim 0,
`torch.chunk` sizes). A tensor is read by name, or, for
the stacked experts transformers keeps in memory, assembled from the checkpoint's per-expert
tensors of the experts in the rank's range. Files are read with plain reads at the offsets their
headers give (no mmap: nothing a rank does not own becomes resident in it). A tensor the folder lacks, or
a layout prl does not know how to slice, is an error naming it (never a random init).

Non-persistent buffers (rotary frequencies) are not in checkpoints; they are recomputed by a fresh
CPU instance of their module.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from prl.model import families
from prl.model.lora import is_adapter
from prl.model.mtp import draft_names
from prl.model.pretrained import PretrainedError, weight_files
from prl.parallel_dims import shard_layout

def meta_model(model_dir: str | Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from prl.model import dsa

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dsa.install(model)
    return model


SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8,
                      "F8_E4M3": torch.float8_e4m3fn, "BOOL": torch.bool}


class Checkpoint:
    """Tensor name -> (file, dtype, shape, byte offset) of a safetensors folder, from the headers.
    Rows are read with plain file reads of just their bytes: no mmap, so nothing of the files the
    rank does not own is ever resident in it."""

    def __init__(self, folder: Path):
        from prl.model.pretrained import read_header

        self.entries = {}
        for path in weight_files(folder):
            header = read_header(path)
            with open(path, "rb") as f:
                base = 8 + int.from_bytes(f.read(8), "little")
            for name, e in header.items():
                if name == "__metadata__":
                    continue
                if e["dtype"].startswith("F8"):
                    raise PretrainedError(f"{path}: {name} is {e['dtype']}: a quantized (FP8) folder; the trainer "
                                          f"loads bf16/fp32 weights (dequantize the folder first)")
                if e["dtype"] not in SAFETENSORS_DTYPES:
                    raise PretrainedError(f"{path}: {name} has dtype {e['dtype']}, which prl does not read")
                self.entries[name] = (path, SAFETENSORS_DTYPES[e["dtype"]], e["shape"], base + e["data_offsets"][0])

    def read_into(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        """Rows start.. of tensor `name` straight into `out` (contiguous; its shape says how many)."""
        if name not in self.entries:
            raise PretrainedError(f"the pretrained folder has no tensor {name!r}")
        path, dtype, shape, offset = self.entries[name]
        want = [out.shape[0], *shape[1:]] if shape else []
        if list(out.shape) != want or out.dtype != dtype or start + (out.shape[0] if shape else 0) > (shape or [0])[0]:
            raise PretrainedError(f"{name}: the folder holds {dtype} {shape}, the model wants rows {start}.. as "
                                  f"{out.dtype} {list(out.shape)} (a different model config?)")
        row = math.prod(shape[1:]) * out.element_size()
        with open(path, "rb") as f:
            f.seek(offset + start * row)
            if f.readinto(out.reshape(-1).view(torch.uint8).numpy()) != out.numel() * out.element_size():
                raise PretrainedError(f"{path}: {name} is truncated")


def row_range(t: torch.Tensor) -> tuple[int, int]:
    """The dim-0 rows [start, stop) of the global tensor that this rank's shard of `t` holds (its
    `shard_layout`). Rows are contiguous bytes in a safetensors file; a shard along another dim
    would be a strided read, which prl does not do yet."""
    layout = shard_layout(t)
    if layout is None:
        return 0, t.shape[0] if t.dim() else 0
    if layout.tensor_dim != 0:
        raise NotImplementedError(f"a parameter sharded as {t.placements}: prl loads dim-0 shards only")
    return layout.mine


def fill(ckpt: Checkpoint, name: str, out: torch.Tensor, start: int, stacked: dict[str, tuple[str, ...]]) -> set[str]:
    """This rank's rows of `name` into `out`: by name, or a stacked experts tensor from the folder's
    per-expert tensors (`stacked`, the family spec's map: `gate_up_proj` = gate then up rows of each
    expert). Returns the folder tensors it stands for (all of them, though it reads only its rows)."""
    if name in ckpt.entries:
        ckpt.read_into(name, out, start)
        return {name}
    prefix, _, leaf = name.rpartition(".")
    if leaf not in stacked or not prefix.endswith("experts"):
        raise PretrainedError(f"the pretrained folder has no tensor {name!r}")
    for i in range(out.shape[0]):
        row = 0
        for part in stacked[leaf]:
            src = f"{prefix}.{start + i}.{part}.weight"
            if src not in ckpt.entries:
                raise PretrainedError(f"the pretrained folder has no tensor {name!r} nor {src!r} it is stacked from")
            n = ckpt.entries[src][2][0]
            ckpt.read_into(src, out[i, row:row + n])
            row += n
    return {k for k in ckpt.entries if k.startswith(prefix + ".") and k.endswith(tuple(f".{p}.weight" for p in stacked[leaf]))}


def folder_dtype(ckpt: Checkpoint, name: str, stacked: dict[str, tuple[str, ...]]) -> torch.dtype:
    prefix, _, leaf = name.rpartition(".")
    src = name if name in ckpt.entries else f"{prefix}.0.{stacked.get(leaf, ('?',))[0]}.weight"
    if src not in ckpt.entries:
        raise PretrainedError(f"the pretrained folder has no tensor {name!r}")
    return ckpt.entries[src][1]


@torch.no_grad()
def load_sharded(model, folder: Path) -> int:
    """Fill every parameter and persistent buffer of the (parallelized, materialised) model with
    this rank's rows from `folder`, reading into the shards in place; returns the bytes read."""
    ckpt, read, used = Checkpoint(Path(folder)), 0, set()
    fam = families.FAMILIES.get(model.config.model_type)  # only stacked experts need it
    stacked = fam.stacked_experts if fam else {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen or is_adapter(name):  # a tied weight (output head = embeddings) is loaded once, under
            continue  # its first name; LoRA adapters are not in a folder (`prl.model.lora.init_adapters`)
        seen.add(id(t))
        local = t.to_local() if isinstance(t, DTensor) else t
        start, _ = row_range(t)
        dtype = folder_dtype(ckpt, name, stacked)  # e.g. a bf16 folder into fp32 master weights: read, then cast
        direct = local.device.type == "cpu" and local.is_contiguous() and dtype == local.dtype
        target = local.data if direct else torch.empty(local.shape, dtype=dtype)  # GPU shards: staged on the CPU
        used |= fill(ckpt, name, target, start, stacked)
        if not direct:
            local.data.copy_(target)
        read += local.numel() * local.element_size()
    unused = sorted(set(ckpt.entries) - used - draft_names(ckpt.entries, model.config.to_dict()))  # MTP: not trained
    if unused:
        raise PretrainedError(f"{folder}: {len(unused)} tensors the model has no place for, e.g. {unused[:3]} "
                              f"(a different architecture or config?)")
    init_buffers(model)
    return read


def init_buffers(model) -> None:
    """Recompute non-persistent buffers (not in checkpoints) on a fresh CPU instance of their module."""
    for name, buf in list(model.named_non_persistent_buffers()):
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if not hasattr(owner, "config"):
            raise NotImplementedError(f"{name}: a non-persistent buffer of {type(owner).__name__}, which prl "
                                      f"cannot rebuild (no config)")
        fresh = type(owner)(owner.config)
        buf.copy_(getattr(fresh, leaf).to(buf.device, buf.dtype))

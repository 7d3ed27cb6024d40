"""Hugging Face checkpoint format: the tensor names and layouts a `save_pretrained` folder holds.

transformers 5 keeps some weights fused in memory (e.g. Qwen3-MoE's experts as one
`[experts, 2 * dim, hidden]` tensor) and converts them when loading and saving a folder. Engines
that read checkpoints (vLLM's `load_weights`) expect the folder's per-expert names, so weights
published for them are converted here with transformers' own reverse conversion (block-FP8 ones by
`prl.model.fp8_checkpoint.to_fp8_checkpoint`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from prl.model.fp8 import BLOCK

SCALE_SUFFIX = "_scale_inv"  # an FP8 tensor X's fp32 block scales (dequantisation multipliers) are X + this


def to_checkpoint_format(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory state dict of `model` -> the names and layouts `save_pretrained` would write."""
    from transformers.core_model_loading import revert_weight_conversion

    return {k: v.contiguous() for k, v in revert_weight_conversion(model, dict(state)).items()}


def checkpoint_name(model, name: str) -> str:
    """The checkpoint name of `model`'s in-memory tensor `name`, one transformers converts on its own (a dense
    weight: usually the same name)."""
    (out,) = to_checkpoint_format(model, {name: torch.empty(0)})
    return out


def meta_model_of(model_dir: str | Path):
    """The folder's model built from its config.json on the meta device (no memory used)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of the folder's config holds (no memory used); with
    a block-FP8 `quantization_config` (the vLLM FP8 serving layout) the scales of its FP8 weights too."""
    skeleton = meta_model_of(model_dir)
    shapes = {k: tuple(v.shape) for k, v in to_checkpoint_format(skeleton, skeleton.state_dict()).items()}
    fp8 = block_fp8_config(model_dir)
    return {**shapes, **scale_shapes(shapes, fp8)} if fp8 else shapes


def scale_shapes(shapes: dict[str, tuple[int, ...]], config: dict) -> dict[str, tuple[int, ...]]:
    """The `X.weight_scale_inv` tensors a block-FP8 checkpoint of these tensor shapes holds under a
    `quantization_config`: one per 2-D `.weight` outside `modules_to_not_convert` (and its children)."""
    skip = set(config.get("modules_to_not_convert") or ())
    out = {}
    for name, shape in shapes.items():
        parts = name.split(".")[:-1]
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        if not any(".".join(parts[:i]) in skip for i in range(1, len(parts) + 1)):
            out[name + SCALE_SUFFIX] = (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))
    return out


def block_fp8_config(model_dir: str | Path) -> dict | None:
    """The folder's block-FP8 `quantization_config` (prl's serving layout), or None."""
    qc = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config")
    return qc if isinstance(qc, dict) and qc.get("weight_block_size") == [BLOCK, BLOCK] else None

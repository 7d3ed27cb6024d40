"""Hugging Face checkpoint format: the tensor names and layouts a `save_pretrained` folder holds.

transformers 5 keeps some weights fused in memory (e.g. Qwen3-MoE's experts as one
`[experts, 2 * dim, hidden]` tensor) and converts them when loading and saving a folder. Engines
that read checkpoints (vLLM's `load_weights`) expect the folder's per-expert names, so weights
published for them are converted here with transformers' own reverse conversion.
"""

from __future__ import annotations

from pathlib import Path

import torch


def to_checkpoint_format(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory state dict of `model` -> the names and layouts `save_pretrained` would write."""
    from transformers.core_model_loading import revert_weight_conversion

    return {k: v.contiguous() for k, v in revert_weight_conversion(model, dict(state)).items()}


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of the folder's config holds (no memory used)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return {k: tuple(v.shape) for k, v in to_checkpoint_format(skeleton, skeleton.state_dict()).items()}

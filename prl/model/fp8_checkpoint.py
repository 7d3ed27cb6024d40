"""Block-FP8 weights on disk, in the layout of the published DeepSeek-V3 / GLM-5-FP8 checkpoints.

Every FP8 linear `X.weight` is stored as E4M3 with `X.weight_scale_inv` (fp32, one per 128x128
block, the dequantisation multiplier); 3-D expert stacks `X.gate_up_proj` / `X.down_proj` get
`X.gate_up_proj_scale_inv` / `X.down_proj_scale_inv` of shape [E, N/128, K/128]. The config gets
`quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [128, 128]}`. Used by `prl ckpt export --fp8` and by weight publishing when
both trainer and engine run FP8 (half the bytes of bf16, and the engine does not requantise).
"""

from __future__ import annotations

import torch

from prl.model.fp8 import BLOCK, E4M3, Quantized, apply_fp8, dequantize, quantize_blocks

SCALE_SUFFIX = "_scale_inv"
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}


def fp8_tensor_names(model) -> list[str]:
    """State-dict keys that are stored in FP8: the weights of the layers `apply_fp8` swaps."""
    return tensor_names(apply_fp8(model, swap=False)["fp8"])


def tensor_names(fp8_modules: list[str]) -> list[str]:
    names = []
    for mod in fp8_modules:
        if mod.endswith("experts"):
            names += [f"{mod}.gate_up_proj", f"{mod}.down_proj"]
        else:
            names.append(f"{mod}.weight")
    return names


def quantize_state_dict(state_dict: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    out = dict(state_dict)
    for name in names:
        w = state_dict[name]
        qs = [quantize_blocks(m) for m in (w if w.dim() == 3 else w[None])]
        q, s = torch.stack([x.q for x in qs]), torch.stack([x.scale for x in qs])
        out[name], out[name + SCALE_SUFFIX] = (q, s) if w.dim() == 3 else (q[0], s[0])
    return out


def dequantize_state_dict(state_dict: dict[str, torch.Tensor], dtype=torch.float32) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state_dict.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = state_dict.get(name + SCALE_SUFFIX)
        if t.dtype == E4M3 and scale is None:
            raise ValueError(f"{name} is FP8 but {name + SCALE_SUFFIX} is missing")
        out[name] = t if scale is None else dequantize_entry(t, scale).to(dtype)
    return out


def dequantize_entry(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One stored FP8 tensor (2-D weight or 3-D expert stack) back to fp32."""
    if q.dim() == 3:
        return torch.stack([dequantize(Quantized(a, b, (BLOCK, BLOCK))) for a, b in zip(q, scale)])
    return dequantize(Quantized(q, scale, (BLOCK, BLOCK)))

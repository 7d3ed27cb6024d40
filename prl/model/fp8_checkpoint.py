"""Block-FP8 weights, in memory and on disk in the layout of the DeepSeek-V3 / GLM-5-FP8 checkpoints.

Every FP8 linear `X.weight` is stored as E4M3 with `X.weight_scale_inv` (fp32, one per 128x128
block, the dequantisation multiplier). In the model's in-memory names (what the embedded engine
takes) 3-D expert stacks `X.gate_up_proj` / `X.down_proj` get `X.gate_up_proj_scale_inv` /
`X.down_proj_scale_inv` of shape [E, N/128, K/128]; in checkpoint names (`to_fp8_checkpoint`: what
vLLM's loader and `prl ckpt export --fp8` take) each expert's `X.{e}.gate_proj.weight`, `up_proj`
and `down_proj` has its own `weight_scale_inv`, split from the stack along whole 128-row blocks, so
the values are the trainer's. The config gets `quantization_config = {quant_method: fp8, fmt: e4m3,
activation_scheme: dynamic, weight_block_size: [128, 128], modules_to_not_convert: [...]}`
(`serving_config`: every module that keeps a high-precision weight). Used by `prl ckpt export --fp8`
and by weight publishing when both trainer and engine run FP8 (half the bytes of bf16, and the
engine does not requantise).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from prl.model.families import STACKED_EXPERTS
from prl.model.fp8 import BLOCK, E4M3, Quantized, apply_fp8, dequantize, quantize_blocks
from prl.model.hf_format import SCALE_SUFFIX, meta_model_of, to_checkpoint_format

QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
PER_EXPERT = re.compile(r"^(.+)\.(\d+)\.(\w+)\.weight$")  # M.{e}.gate_proj.weight: module, expert, leaf


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


# ---------------------------------------------------------------- checkpoint names (vLLM, export)
def checkpoint_fp8_names(fp8_names: list[str], names, stacked: dict = STACKED_EXPERTS) -> list[str]:
    """Of the checkpoint names `names`, those holding the FP8 tensors `fp8_names` (in-memory names): a
    2-D `X.weight` keeps its name; a stack `M.gate_up_proj` is every expert's `M.{e}.gate_proj.weight`
    and `M.{e}.up_proj.weight` (`stacked`: the family's stacked -> per-expert leaf names)."""
    plain, stacks = set(), {}
    for name in fp8_names:
        module, _, leaf = name.rpartition(".")
        if leaf in stacked:
            stacks.setdefault(module, set()).update(stacked[leaf])
        else:
            plain.add(name)
    return [n for n in names if n in plain or per_expert_of(n, stacks)]


def per_expert_of(name: str, stacks: dict[str, set[str]]) -> bool:
    m = PER_EXPERT.match(name)
    return bool(m) and m.group(3) in stacks.get(m.group(1), ())


def to_fp8_checkpoint(model, part: dict[str, torch.Tensor], fp8_names: list[str]) -> dict[str, torch.Tensor]:
    """Part of the in-memory state -> checkpoint names and layouts, its FP8 tensors block-quantised
    with their scales. Fails when an FP8 tensor of `part` maps to no checkpoint tensor."""
    from prl.model.families import spec

    stacked = spec(model.config.model_type, "FP8 checkpoint names").stacked_experts
    out = to_checkpoint_format(model, part)
    wanted = [n for n in fp8_names if n in part]
    lost = [n for n in wanted if not checkpoint_fp8_names([n], out, stacked)]
    if lost:
        raise ValueError(f"FP8 tensors {lost[:3]} have no checkpoint counterpart in {sorted(out)[:5]}...")
    return quantize_state_dict(out, checkpoint_fp8_names(wanted, out, stacked))


def serving_config(model) -> dict:
    """The `quantization_config` under which an engine (vLLM's `Fp8Config`) builds exactly the FP8
    layers prl publishes: `modules_to_not_convert` names every module whose weight stays in high
    precision (routers, embeddings, head, the indexer, kept linears and expert stacks), the same in a
    checkpoint's MTP draft layers (`prl.model.mtp`)."""
    from prl.model.mtp import draft_kept_modules

    fp8 = set(apply_fp8(model, swap=False)["fp8"])
    kept = sorted({name.rpartition(".")[0] for name, p in model.named_parameters() if p.dim() >= 2} - fp8)
    drafts = draft_kept_modules(kept, model.config.to_dict())  # MTP layers: FP8 exactly where the last layer is
    return {**QUANTIZATION_CONFIG, "modules_to_not_convert": sorted(kept + drafts)}


def write_serving_config(model_dir: str | Path, fp8: bool) -> dict | None:
    """Put (`fp8`) or take out the serving `quantization_config` of the folder's config.json, in place
    (written whole under a name of its own, then renamed in, so concurrent readers and writers see one
    whole file); returns what is there after."""
    import os

    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    want = serving_config(meta_model_of(model_dir)) if fp8 else None
    if config.get("quantization_config") == want:
        return want
    config.pop("quantization_config", None)
    if want is not None:
        config["quantization_config"] = want
    tmp = path.with_name(f".config.json.{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return want

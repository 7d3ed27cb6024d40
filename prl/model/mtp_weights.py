"""The tensors of a checkpoint's MTP draft layers (`prl.model.mtp` names them): read from a folder,
made block-FP8 for vLLM's drafter, copied into an export, or added to a test folder."""

from __future__ import annotations

import json
from pathlib import Path

from prl.model.mtp import draft_layers, is_draft


def read_draft(folder) -> dict:
    """The folder's draft-layer tensors, by checkpoint name, as stored ({} without MTP layers)."""
    from safetensors import safe_open

    from prl.model.pretrained import weight_files

    layers, out = draft_layers(read_config(folder)), {}
    if not layers:  # no MTP layer declared (a random-init tiny model's folder has no weights at all)
        return out
    for f in weight_files(Path(folder)):
        with safe_open(f, "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys() if is_draft(k, layers)})
    return out


def quantize_draft(state: dict, qc: dict | None) -> dict:
    """Block-FP8 (with `weight_scale_inv`) every 2-D weight the serving `quantization_config` makes FP8."""
    from prl.model.fp8_checkpoint import quantize_state_dict
    from prl.model.hf_format import SCALE_SUFFIX, scale_shapes

    if not qc or not state:
        return state
    scales = scale_shapes({k: tuple(v.shape) for k, v in state.items()}, qc)
    return quantize_state_dict(state, [k[: -len(SCALE_SUFFIX)] for k in scales])


def draft_state(model_dir) -> dict:
    """What vLLM's drafter loads when prl's FP8 serving started it on dummy weights: the folder's draft
    layer, block-FP8 where the folder's serving `quantization_config` says."""
    from prl.model.hf_format import block_fp8_config

    return quantize_draft(read_draft(model_dir), block_fp8_config(model_dir))


def copy_draft_layers(src, out) -> int:
    """`prl ckpt export`: the run's model folder's draft layers, unchanged (FP8 where `out`'s serving
    layout says), into the exported folder as a shard of their own; returns the tensors written."""
    from prl.model.hf_format import block_fp8_config

    raw = read_draft(src)
    if not raw:
        return 0
    state = quantize_draft(raw, block_fp8_config(out))
    add_shard(out, state, {"num_nextn_predict_layers": read_config(src)["num_nextn_predict_layers"]})
    return len(state)


def add_shard(folder, tensors: dict, config_update: dict, name: str = "model-mtp.safetensors") -> None:
    """Write `tensors` as one more safetensors file of `folder`, listed in its index (a lone
    `model.safetensors` is renamed and listed first: transformers reads it alone where it exists), and
    update its config.json."""
    from safetensors.torch import save_file

    from prl.model.pretrained import INDEX, SINGLE, read_header, weight_files

    folder = Path(folder)
    if (folder / SINGLE).is_file() and not (folder / INDEX).exists():  # loaders take a lone model.safetensors
        (folder / SINGLE).rename(folder / "model-main.safetensors")  # whole, index or not: list it instead
        (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {
            k: "model-main.safetensors" for k in read_header(folder / "model-main.safetensors") if k != "__metadata__"}}))
    weight_map = {k: f.name for f in weight_files(folder) for k in read_header(f) if k != "__metadata__"}
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / name, metadata={"format": "pt"})
    weight_map.update({k: name for k in tensors})
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps({**read_config(folder), **config_update}, indent=2))


def read_config(folder) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def add_draft_layer(folder, seed: int = 0) -> int:
    """Give a saved model folder one MTP layer, the way DeepSeek-style checkpoints ship it: a copy of
    its last decoder layer as `model.layers.{L}` plus the layer's own `enorm`, `hnorm`, `eh_proj` and
    `shared_head` (norm and output head). For tests and `bin/gpu-check` (prl's tiny models have no
    MTP). Returns L, the draft layer's index."""
    import torch
    from safetensors import safe_open

    from prl.model.pretrained import weight_files

    config = read_config(folder)
    n, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    last, new, top = f"model.layers.{n - 1}.", f"model.layers.{n}.", {}
    out = {}
    for f in weight_files(Path(folder)):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                if k.startswith(last):
                    out[k.replace(last, new)] = st.get_tensor(k).clone()
                elif k in ("model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"):
                    top[k] = st.get_tensor(k)
    like = top["model.norm.weight"]
    g = torch.Generator().manual_seed(seed)
    out[new + "enorm.weight"] = torch.ones_like(like)
    out[new + "hnorm.weight"] = torch.ones_like(like)
    out[new + "eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=g) * 0.02).to(like.dtype)
    out[new + "shared_head.norm.weight"] = like.clone()
    out[new + "shared_head.head.weight"] = top.get("lm_head.weight", top["model.embed_tokens.weight"]).clone()
    add_shard(folder, out, {"num_nextn_predict_layers": 1})
    return n

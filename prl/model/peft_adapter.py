"""LoRA adapters as a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`), and prl's own merge of such
a folder into a base Hugging Face folder.

In the folder a target module `X` (its Hugging Face checkpoint path) has `base_model.model.X.lora_A.weight`
`[r, in]` and `base_model.model.X.lora_B.weight` `[out, r]`, B not scaled: the merged weight is
`W + lora_alpha / r * B @ A` (`lora_alpha / sqrt(r)` under `use_rslora`).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch

from prl.model.lora import B, check_adapter, merged, target_of

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


class AdapterError(ValueError):
    """A PEFT folder prl cannot write or merge; the message names what is wrong, in one line."""


def adapter_config(rank: int, alpha: float, dropout: float, targets: list[str] | str) -> dict:
    """A PEFT LoraConfig as saved (`targets`: module leaf names, or a regex matched against whole module names)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "revision": None,
            "inference_mode": True, "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
            "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}


def peft_targets(adapted: set[str], linears: list[str]) -> list[str] | str:
    """The `target_modules` that selects exactly the `adapted` modules among a model's `linears` (module names)
    as PEFT matches them: their leaf names where those pick no other module, else a regex over the layers,
    else the names themselves."""
    leaves = sorted({n.rpartition(".")[2] for n in adapted})
    by_layer = sorted({re.escape(re.sub(r"\.layers\.\d+\.", ".layers.LAYER.", n)).replace("LAYER", r"\d+")
                       for n in adapted})
    for spec in (leaves, "|".join(by_layer), "|".join(re.escape(n) for n in sorted(adapted))):
        if {n for n in linears if peft_matches(spec, n)} == adapted:
            return spec
    raise AdapterError(f"no target_modules selects the adapted modules {sorted(adapted)[:3]} alone")


def peft_matches(spec: list[str] | str, name: str) -> bool:
    """Whether PEFT's `target_modules = spec` targets module `name`: a string is a regex matched against the
    whole name, a list holds names a module's name equals or ends with (after a dot)."""
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return any(name == t or name.endswith("." + t) for t in spec)


def write_adapter(out: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """`tensors`: `X.lora_A` / `X.lora_B` (X a checkpoint module path, B not scaled) -> a PEFT folder `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    named = {PREFIX + k + ".weight": v.contiguous() for k, v in sorted(tensors.items())}
    save_file(named, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_adapter(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A PEFT LoRA folder -> (`X.lora_A` / `X.lora_B` with the scale folded into B, as prl publishes them; its
    config). Refuses what a plain merge of `B @ A` cannot express."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG).read_text())
        raw = load_file(str(folder / WEIGHTS))
    except (OSError, ValueError) as e:
        raise AdapterError(f"{folder}: not a PEFT adapter folder ({type(e).__name__}: {e})") from None
    unsupported = {"peft_type": config.get("peft_type") != "LORA", "use_dora": bool(config.get("use_dora")),
                   "fan_in_fan_out": bool(config.get("fan_in_fan_out")), "bias": config.get("bias", "none") != "none",
                   "modules_to_save": bool(config.get("modules_to_save")),
                   "rank_pattern": bool(config.get("rank_pattern")), "alpha_pattern": bool(config.get("alpha_pattern"))}
    bad = [f"{k} = {json.dumps(config.get(k))}" for k, v in unsupported.items() if v]
    if bad:
        raise AdapterError(f"{folder / CONFIG}: {', '.join(bad)} is not supported (a plain LoRA adapter only)")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"{folder / CONFIG}: r = {r!r}, lora_alpha = {alpha!r}: a positive integer and a number")
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    out = {}
    for key, t in raw.items():
        m = re.fullmatch(rf"{re.escape(PREFIX)}(.+)(\.lora_[AB])\.weight", key)
        if m is None:
            raise AdapterError(f"{folder / WEIGHTS}: {key!r} is not a LoRA tensor name ({PREFIX}X.lora_A.weight)")
        out[m.group(1) + m.group(2)] = t * scale if m.group(2) == B else t
    return out, config


def merge_adapter(adapter_dir: Path, base_dir: Path, out: Path) -> Path:
    """The Hugging Face folder `base_dir` with the PEFT adapter of `adapter_dir` merged into its weights, written
    to `out` (every other file copied as it is)."""
    from safetensors.torch import load_file, save_file

    from prl.model.pretrained import PretrainedError, has_weights, read_header, weight_files

    adapter, _ = read_adapter(adapter_dir)
    base_dir, out = Path(base_dir), Path(out)
    if not has_weights(base_dir):
        raise AdapterError(f"{base_dir}: no model.safetensors (or its index): the base must be a Hugging Face folder "
                           f"with safetensors weights")
    try:
        files = weight_files(base_dir)
        headers = {f: read_header(f) for f in files}
    except PretrainedError as e:
        raise AdapterError(str(e)) from None
    where = {k: f for f, h in headers.items() for k in h if k != "__metadata__"}
    problems = check_adapter(adapter, {k: tuple(headers[f][k]["shape"]) for k, f in where.items()})
    if problems:
        raise AdapterError(f"{adapter_dir} does not fit {base_dir}: {'; '.join(problems[:3])}")
    if out.resolve() == base_dir.resolve():
        raise AdapterError(f"{out}: the merged folder must not be the base folder")
    out.mkdir(parents=True, exist_ok=True)
    for src in sorted(base_dir.iterdir()):
        if src in files:
            state = load_file(str(src))
            mine = {k: v for k, v in adapter.items() if where[target_of(k)] == src}
            state.update(merged(state, mine) if mine else {})
            save_file(state, str(out / src.name), metadata={"format": "pt"})
        elif src.is_dir():
            shutil.copytree(src, out / src.name, dirs_exist_ok=True)
        else:
            shutil.copy2(src, out / src.name)
    return out

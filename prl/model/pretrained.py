"""Pretrained Hugging Face folders: checked before a run starts, linked into the run, loaded whole.

Rules:
- weights are safetensors only (`model.safetensors`, or the shards `model.safetensors.index.json`
  lists); a folder with only `pytorch_model.bin` is refused with the fix;
- checks read file headers only (no torch, no tensor data), so `prl run` and `--dry-run` can refuse
  a broken folder in a second, naming the file;
- the run's model folder gets copies of the small files (config, tokenizer) and symlinks to the
  weight files: a 1.5 TB checkpoint is never copied, and on a cluster the path must exist on
  every host that trains or serves;
- loading fails if any tensor is missing, unexpected or of the wrong shape: transformers would
  otherwise random-init it silently, and step 0 would not train the model the user gave. The one
  exception is a checkpoint's MTP draft layers, set aside by name (`prl.model.mtp`).
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from prl.model.families import routed_experts

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SMALL_SUFFIXES = {".json", ".txt", ".model", ".tiktoken", ".jinja", ".py"}
SMALL_LIMIT = 64 << 20


class PretrainedError(ValueError):
    """A pretrained folder prl cannot use; the message names the folder or file and the fix."""


@dataclass
class FolderInfo:
    model_type: str
    files: list[Path]
    tensors: int
    bytes: int
    max_position_embeddings: int | None
    head_dim: int | None  # attention head size, where the config says (nested configs: None)
    num_experts: int | None = None  # routed experts per MoE layer, where the config says
    draft_layers: int = 0  # MTP layers the config declares and the folder holds (`prl.model.mtp`)
    missing_draft: tuple[int, ...] = ()  # MTP layers the config declares whose tensors are missing
    names: tuple[str, ...] = ()  # every tensor's name, from the headers
    architectures: tuple[str, ...] = ()  # config.json's class names (a causal LM, a classifier, ...)
    labels: int = 2  # a classifier's outputs (config.json's id2label, or num_labels)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder, from its index when sharded."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise PretrainedError(f"{folder / INDEX}: not a safetensors index ({type(e).__name__}: {e})") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise PretrainedError(f"{folder / INDEX}: lists shards that are missing: {missing[:5]}")
        return [folder / n for n in names]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    if any(folder.glob("*.bin")):
        raise PretrainedError(f"{folder}: only PyTorch .bin weights; prl reads safetensors (convert with "
                              f"`AutoModelForCausalLM.from_pretrained(...).save_pretrained(...)`)")
    raise PretrainedError(f"{folder}: no {SINGLE} and no {INDEX}: not a Hugging Face folder with weights")


def has_weights(folder: Path) -> bool:
    return (Path(folder) / INDEX).exists() or (Path(folder) / SINGLE).exists()


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes, offsets)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise PretrainedError(f"{path}: truncated safetensors file ({path.stat().st_size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(path.stat().st_size - 8, 100 << 20):
                raise PretrainedError(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PretrainedError(f"{path}: unreadable safetensors header ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise PretrainedError(f"{path}: not a safetensors file (header is not a table)")
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, IndexError, ValueError):
        raise PretrainedError(f"{path}: not a safetensors file (a tensor entry has no data_offsets)") from None
    if 8 + n + end > path.stat().st_size:
        raise PretrainedError(f"{path}: truncated ({path.stat().st_size} bytes, header needs {8 + n + end})")
    return header


def check_pretrained(folder: str | Path) -> FolderInfo:
    folder = Path(folder)
    if not folder.is_dir():
        raise PretrainedError(f"{str(folder)!r} is not a folder")
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PretrainedError(f"{config_path}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise PretrainedError(f"{config_path}: no model_type; not a transformers model folder")
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise PretrainedError(f"{folder}: no tokenizer (tokenizer.json or tokenizer_config.json)")
    from prl.model.mtp import draft_layers, missing_draft_layers

    files = weight_files(folder)
    names = [k for f in files for k in read_header(f) if k != "__metadata__"]
    missing = tuple(missing_draft_layers(names, config))
    return FolderInfo(config["model_type"], files, len(names), sum(f.stat().st_size for f in files),
                      config.get("max_position_embeddings"), attention_head_dim(config), routed_experts(config),
                      len(draft_layers(config)) - len(missing), missing, tuple(names),
                      tuple(a for a in config.get("architectures") or [] if isinstance(a, str)),
                      label_count(config))


def label_count(config: dict) -> int:
    """A classifier's outputs: its id2label's length, else num_labels (transformers' default 2)."""
    labels = config.get("id2label")
    return len(labels) if isinstance(labels, (dict, list)) and labels else config.get("num_labels", 2)


def attention_head_dim(config: dict) -> int | None:
    if isinstance(config.get("head_dim"), int):
        return config["head_dim"]
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def link_pretrained(src: Path, out: Path) -> Path:
    """Copy the small files of `src` into `out` and symlink its weight files."""
    src = Path(src).resolve()
    info = check_pretrained(src)
    out.mkdir(parents=True, exist_ok=True)
    weights = {f.name for f in info.files} | {INDEX}
    for p in sorted(src.iterdir()):
        if p.name in weights and p.is_file():
            (out / p.name).symlink_to(p)
        elif p.is_file() and p.suffix in SMALL_SUFFIXES and p.stat().st_size < SMALL_LIMIT:
            shutil.copyfile(p, out / p.name)
    return out


def load_pretrained(folder: Path, dtype, head: str = "causal"):
    """`from_pretrained`, refusing a folder whose tensors do not match its config exactly. `head`: "causal" (a
    language model) or "reward" (a sequence classifier, `check_reward_model`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from prl.model.mtp import draft_layers

    config = AutoConfig.from_pretrained(folder)
    auto = AutoModelForCausalLM if head == "causal" else AutoModelForSequenceClassification
    cls = auto._model_mapping[type(config)]
    drafts = [rf"^model\.layers\.{i}\." for i in draft_layers(config.to_dict())]
    if drafts:  # a checkpoint's MTP layers (`prl.model.mtp`): not trained, set aside by name, not reported
        cls = type(cls.__name__, (cls,), {"_keys_to_ignore_on_load_unexpected":
                                          [*(cls._keys_to_ignore_on_load_unexpected or []), *drafts]})
    model, info = cls.from_pretrained(folder, config=config, dtype=dtype, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        detail = "; ".join(f"{k}: {sorted(map(str, v))[:5]}" for k, v in problems.items())
        raise PretrainedError(f"{folder}: weights do not match config.json ({detail})")
    return model


def check_language_model(folder: str | Path) -> FolderInfo:
    """A model the run serves to generate or score tokens (a teacher, a judge): a model folder whose architecture is
    a causal language model."""
    info = check_pretrained(folder)
    if not any(a.endswith("ForCausalLM") for a in info.architectures):
        raise PretrainedError(f"{folder}: architecture {list(info.architectures) or 'unnamed'} is not a causal "
                              f"language model (...ForCausalLM)")
    return info


def check_reward_model(folder: str | Path) -> FolderInfo:
    """A reward model's folder: a model folder (`check_pretrained`) whose architecture is a sequence classifier
    with one label (the score). Reads config.json and headers only."""
    info = check_pretrained(folder)
    if not any(a.endswith("ForSequenceClassification") for a in info.architectures):
        raise PretrainedError(f"{folder}: architecture {list(info.architectures) or 'unnamed'} has no classification "
                              f"head; a reward model is a ...ForSequenceClassification folder with one label")
    if info.labels != 1:
        raise PretrainedError(f"{folder}: a classifier of {info.labels} labels; a reward model has one (its score)")
    return info

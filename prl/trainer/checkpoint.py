"""Resumable checkpoints (model, optimizer, step, data position) and policy publishing.

Both gather full state dicts from the FSDP2 shards (a collective: every rank calls) and rank 0
writes a sealed folder (`prl.model.weights`): a checkpoint is whole or absent, and a damaged one
is refused with the name of the damaged file.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from prl.model.weights import (
    WEIGHTS_FILE,
    CorruptWeightsError,
    commit_dir,
    latest_checkpoint,
    prune_versions,
    read_weights,
    save_tensors,
    tmp_dir_for,
    version_dir,
    write_weights,
)

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
OPTIM_FILE = "optim.pt"


def full_model_state(model) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=FULL)


def publish(model, root: Path, version: int, keep: int, fp8_names: list[str] | None = None,
            hf_format: bool = False) -> Path | None:
    """Seal weights vN for the inference servers; older versions beyond `keep` are pruned.
    With `fp8_names` those tensors are published block-FP8 (engine and trainer both run FP8).
    With `hf_format` in Hugging Face checkpoint names and layouts (what vLLM's `load_weights` reads);
    else in the model's in-memory names (what the embedded engine copies in)."""
    state = full_model_state(model)
    if dist.get_rank() != 0:
        return None
    meta = {"version": version, "format": "hf" if hf_format else "memory"}
    if hf_format:
        from prl.model.hf_format import to_checkpoint_format

        state = to_checkpoint_format(model, state)
    if fp8_names:
        from prl.model.fp8_checkpoint import quantize_state_dict

        state = quantize_state_dict(state, fp8_names)
    path = write_weights(version_dir(root, version), state, meta)
    prune_versions(root, keep)
    return path


def save_checkpoint(model, optimizer, root: Path, step: int, data_position: int) -> Path | None:
    model_state = full_model_state(model)
    optim_state = get_optimizer_state_dict(model, optimizer, options=FULL)
    if dist.get_rank() != 0:
        return None
    final = root / f"step_{step}"
    tmp = tmp_dir_for(final)
    save_tensors(tmp / WEIGHTS_FILE, model_state)
    torch.save(optim_state, tmp / OPTIM_FILE)
    return commit_dir(tmp, final, {"step": step, "data_position": data_position})


def load_checkpoint(model, optimizer, root: Path) -> dict | None:
    """Restore the newest checkpoint into (model, optimizer); returns its meta or None.

    Only rank 0 reads the disk (trainer hosts share no storage): it picks the checkpoint, sends
    its meta to the other ranks, and the state is broadcast from rank 0 into every rank's shards."""
    loaded = _read_checkpoint(root) if dist.get_rank() == 0 else None
    info = [loaded[2] if loaded else None]
    dist.broadcast_object_list(info, src=0)
    if info[0] is None:
        return None
    model_state, optim_state = loaded[:2] if loaded else ({}, {})
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, model_state, options=opts)
    set_optimizer_state_dict(model, optimizer, optim_state, options=opts)
    return info[0]


def _read_checkpoint(root: Path) -> tuple[dict, dict, dict] | None:
    """(model state, optimizer state, meta) of the newest checkpoint under `root`, or None."""
    found = latest_checkpoint(root)
    if not found:
        return None
    path, _ = found
    try:
        model_state, manifest = read_weights(path)
        optim_state = torch.load(path / OPTIM_FILE, weights_only=False)
    except CorruptWeightsError:
        raise
    except Exception as e:  # noqa: BLE001 - unreadable despite a matching manifest
        raise CorruptWeightsError(f"{path}: unreadable checkpoint ({e})") from None
    return model_state, optim_state, {"step": manifest["step"], "data_position": manifest["data_position"],
                                      "path": str(path)}

"""Resumable checkpoints (model, optimizer, step, data position); publishing is `prl.trainer.publish`.

Checkpoints come in two formats, both sealed folders (`prl.model.weights`: manifest with every
file's hash written last, then renamed in), so a checkpoint is whole or absent and a damaged one is
refused with the name of the damaged file:
- "dcp" (sharded): every rank writes its own shards of the model and optimizer state with
  `torch.distributed.checkpoint`; nothing is gathered. Loading reshards, so a run resumes on a
  different number of ranks or parallel layout. Every rank reads the folder: the trainer's ranks
  share one host or a checkpoint folder (`trainer.checkpoint_format = "auto"` picks it there).
- "full": rank 0 gathers the whole state (a collective) and writes one safetensors file and the
  optimizer; on resume rank 0 alone reads it and broadcasts (trainer hosts share no storage).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from prl.model.lora import is_adapter
from prl.model.weights import (
    WEIGHTS_FILE,
    WEIGHTS_PREFIX,
    CorruptWeightsError,
    commit_dir,
    file_entry,
    latest_checkpoint,
    save_tensors,
    tmp_dir_for,
    verify_dir,
)

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
OPTIM_FILE = "optim.pt"
SHARE_TOKEN = ".prl-share-check"


def model_options(model, **kw) -> StateDictOptions:
    """What a checkpoint of `model` holds: every weight, or under LoRA the adapters alone (the frozen base is
    the step-0 checkpoint's, `load_model_state`)."""
    adapters = any(is_adapter(n) for n, _ in model.named_parameters())
    return StateDictOptions(ignore_frozen_params=adapters, strict=not adapters, **kw)


def full_model_state(model) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=model_options(model, full_state_dict=True, cpu_offload=True))


def sharded_format(choice: str, shared: bool = False) -> bool:
    """Whether checkpoints are written sharded: "auto" when every rank can read every rank's files,
    i.e. all ranks are on this host (torchrun's local world is the whole world) or the checkpoint
    folder is shared between the trainer hosts (`cluster.shared_checkpoints`)."""
    if choice != "auto":
        return choice == "sharded"
    return shared or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())) == dist.get_world_size()


def save_checkpoint(model, optimizer, root: Path, step: int, data_position: int, sharded: bool = False,
                    data_ahead: list[int] = (), snapshot: bool | None = None, extra: dict | None = None) -> Path | None:
    """`snapshot` (default: `optimizer` None): a weights-only snapshot, `root/weights_<step>` (a run never
    resumes from one). `extra`: more manifest fields (LoRA's adapter layout)."""
    meta = {"step": step, "data_position": data_position, "data_ahead": list(data_ahead), **(extra or {})}
    snapshot = optimizer is None if snapshot is None else snapshot
    final = root / (f"{WEIGHTS_PREFIX}{step}" if snapshot else f"step_{step}")
    if sharded:
        return save_sharded(model, optimizer, final, meta)
    model_state = full_model_state(model)
    optim_state = get_optimizer_state_dict(model, optimizer, options=FULL) if optimizer is not None else None

    def write() -> Path:
        tmp = tmp_dir_for(final)
        save_tensors(tmp / WEIGHTS_FILE, model_state)
        if optim_state is not None:
            torch.save(optim_state, tmp / OPTIM_FILE)
        return commit_dir(tmp, final, {**meta, "format": "full"})

    return on_rank0(write, final)


def on_rank0(write, final: Path) -> Path | None:
    """Rank 0 runs `write` (sealing a checkpoint); every rank learns whether it worked and raises the
    same error if not, so none goes on into the next step's collectives alone. Rank 0 gets the path."""
    path, error = None, None
    if dist.get_rank() == 0:
        try:
            path = write()
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = f"{final}: could not be written ({type(e).__name__}: {e})"
    sent = [error]
    dist.broadcast_object_list(sent, src=0)
    if sent[0]:
        raise CheckpointError(sent[0])
    return path


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read where this run put it; the message says why."""


def shard_file(rank: int) -> str:
    """The file `torch.distributed.checkpoint` writes for one rank (`single_file_per_rank`)."""
    return f"__{rank}_0.distcp"


def save_sharded(model, optimizer, final: Path, meta: dict) -> Path | None:
    """Every rank writes its shards into one temporary folder (rank 0 makes it and sends its name;
    each rank finds it under its own path to the checkpoint folder, which must be the same shared
    folder: checked before anything is written) and hashes its own file; rank 0 seals the folder
    once DCP's closing collective says every rank's files and the metadata are written."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tmp = _shared_tmp(final)
    state = {"model": get_model_state_dict(model, options=model_options(model))}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True))
    own = tmp / shard_file(rank)
    try:
        entry = {own.name: file_entry(own)}
    except OSError:
        entry = {}
    entries: list = [None] * world
    dist.all_gather_object(entries, entry)
    known = {name: e for part in entries for name, e in part.items()}
    missing = [r for r in range(world) if shard_file(r) not in known]
    if missing:  # on every rank: none goes on into the next step's collectives alone
        raise CheckpointError(f"{final}: the shards of ranks {missing} are not in the checkpoint folder")
    return on_rank0(lambda: commit_dir(tmp, final, {**meta, "format": "dcp", "ranks": world}, known=known), final)


def _shared_tmp(final: Path) -> Path:
    """The temporary folder every rank writes into: rank 0 makes it with a token file, every rank
    reads the token under its own path. A rank that cannot is on a host that does not share the
    checkpoint folder: every rank raises the same error, before any shard is written."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sent = [None]
    if rank == 0:
        try:
            tmp = tmp_dir_for(final)
            token = secrets.token_hex(16)
            (tmp / SHARE_TOKEN).write_text(token)
            sent = [(tmp.name, token)]
        except OSError as e:
            sent = [(None, f"rank 0 cannot write into {final.parent}: {e}")]
    dist.broadcast_object_list(sent, src=0)
    name, token = sent[0]
    if name is None:
        raise CheckpointError(f"sharded checkpoint {final.name}: {token}")
    tmp = final.parent / name
    try:
        seen = (tmp / SHARE_TOKEN).read_text() == token
    except OSError:
        seen = False
    views: list = [None] * world
    dist.all_gather_object(views, (seen, socket.gethostname(), str(final.parent)))
    blind = [f"rank {r} on {host} ({path})" for r, (ok, host, path) in enumerate(views) if not ok]
    if blind:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"sharded checkpoint {final.name}: {', '.join(blind)} cannot see rank 0's checkpoint folder on "
            f"{views[0][1]}: the trainer hosts do not share it. Set cluster.shared_checkpoints to a folder every "
            f"trainer host mounts, or trainer.checkpoint_format = \"full\"")
    dist.barrier()  # every rank has read the token
    if rank == 0:
        (tmp / SHARE_TOKEN).unlink()
    return tmp


def load_checkpoint(model, optimizer, root: Path, after: int = -1) -> dict | None:
    """Restore the newest checkpoint (of a step past `after`) into (model, optimizer); returns its meta or None.

    Rank 0 picks the checkpoint and checks it: a full one (which rank 0 alone reads and broadcasts)
    every file's hash; a sharded one (every rank reads the shards it needs) the sizes, with the
    hashing shared out between the ranks. Every rank raises the same error for a damaged one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    info = [_pick_checkpoint(root, world, after) if rank == 0 else None]
    dist.broadcast_object_list(info, src=0)
    if info[0] is None:
        return None
    if "error" in info[0]:
        raise CorruptWeightsError(info[0]["error"])
    info[0]["path"] = str(root / info[0]["name"])  # each rank's own path to it (hosts' workdirs differ)
    if info[0]["format"] == "dcp":
        _verify_share(Path(info[0]["path"]), info[0]["files"], rank, world)
        _load_sharded(model, optimizer, Path(info[0]["path"]))
        return info[0]
    model_state, optim_state = _read_full(Path(info[0]["path"])) if rank == 0 else ({}, {})
    set_model_state_dict(model, model_state, options=model_options(model, full_state_dict=True, broadcast_from_rank0=True))
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model, optimizer, optim_state, options=opts)
    return info[0]


def _pick_checkpoint(root: Path, world: int, after: int = -1) -> dict | None:
    """The newest sealed checkpoint under `root` with its step, data position, path and format,
    checked as far as rank 0's part goes; {"error": why} where it is damaged."""
    try:  # every failure goes to the other ranks through the broadcast that follows
        found = latest_checkpoint(root)
        if not found or int(found[0].name.removeprefix("step_")) <= after:
            return None
        path, _ = found
        manifest = verify_dir(path, hash_only=set())
        files = sorted(manifest["files"])
        sharded = manifest.get("format") == "dcp"
        verify_dir(path, hash_only=set(files[0::world]) if sharded else None)
        return {"step": manifest["step"], "data_position": manifest["data_position"],
                "data_ahead": manifest.get("data_ahead", []), "name": path.name,
                "format": manifest.get("format", "full"), "files": files}
    except Exception as e:  # noqa: BLE001 - damaged, unreadable or not a checkpoint of prl's
        return {"error": str(e) if isinstance(e, CorruptWeightsError) else f"{root}: {type(e).__name__}: {e}"}


def _verify_share(path: Path, files: list[str], rank: int, world: int) -> None:
    """Ranks 1.. hash their share of a sharded checkpoint's files (rank 0 did its own in
    `_pick_checkpoint`); every rank raises the first error any rank found."""
    error = None
    if rank != 0:
        try:
            verify_dir(path, hash_only=set(files[rank::world]))
        except CorruptWeightsError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - unreadable here (e.g. not this host's folder): say so on every rank
            error = f"{path}: {type(e).__name__}: {e}"
    errors: list = [None] * world
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CorruptWeightsError(first)


def _load_sharded(model, optimizer, path: Path) -> None:
    opts = model_options(model)
    state = {"model": get_model_state_dict(model, options=opts), "optim": get_optimizer_state_dict(model, optimizer)}
    try:
        dcp.load(state, storage_reader=FileSystemReader(str(path)))
    except Exception as e:  # noqa: BLE001 - hashes matched, yet not a checkpoint of this model
        raise CorruptWeightsError(f"{path}: cannot be loaded into this model ({type(e).__name__}: {str(e)[:500]})") from None
    set_model_state_dict(model, state["model"], options=opts)
    set_optimizer_state_dict(model, optimizer, state["optim"])


def load_model_state(model, path: Path) -> None:
    """The model weights (no optimizer) of the sealed checkpoint at `path` into `model`, on every rank: a
    sharded one read shard by shard, a full one read by rank 0 and broadcast. A LoRA model takes its base
    (every weight but the adapters) from a whole checkpoint."""
    strict = not any(is_adapter(n) for n, _ in model.named_parameters())
    if verify_dir(path, hash_only=set()).get("format") == "dcp":
        state = {"model": {k: v for k, v in get_model_state_dict(model).items() if not is_adapter(k)}}
        dcp.load(state, storage_reader=FileSystemReader(str(path)))
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
        return
    state = load_file(str(path / WEIGHTS_FILE)) if dist.get_rank() == 0 else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                 strict=strict))


def _read_full(path: Path) -> tuple[dict, dict]:
    """(model state, optimizer state) of a verified full checkpoint."""
    try:
        return load_file(str(path / WEIGHTS_FILE)), torch.load(path / OPTIM_FILE, weights_only=False)
    except CorruptWeightsError:
        raise
    except Exception as e:  # noqa: BLE001 - unreadable despite a matching manifest
        raise CorruptWeightsError(f"{path}: unreadable checkpoint ({e})") from None


def read_model_state(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The whole model state of a sealed checkpoint of either format (one process, no ranks: for
    `prl ckpt export` and tests), and its manifest."""
    manifest = verify_dir(path)
    try:
        if manifest.get("format") != "dcp":
            return load_file(str(path / WEIGHTS_FILE)), manifest
        reader = FileSystemReader(str(path))
        entries = reader.read_metadata().state_dict_metadata
        state = {key.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
                 for key, m in entries.items() if key.startswith("model.") and isinstance(m, TensorStorageMetadata)}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    except Exception as e:  # noqa: BLE001 - sealed and hashed, yet not a checkpoint prl can read
        raise CorruptWeightsError(f"{path}: unreadable checkpoint ({type(e).__name__}: {str(e)[:300]})") from None
    return state, manifest

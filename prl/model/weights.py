"""Versioned weight folders: whole or absent.

A folder is written under a temporary name, its files are fsynced, a MANIFEST.json (sizes and
sha256 of every file) is written last, and the folder is renamed into place. Readers ignore any
folder without a manifest and verify every file against it, so a reader never sees half a write
and a corrupted file is reported by name instead of loading garbage.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where tensors are read or written: the driver imports this module
    import torch

MANIFEST = "MANIFEST.json"
WEIGHTS_FILE = "model.safetensors"


class CorruptWeightsError(RuntimeError):
    """A weight or checkpoint folder failed verification; the message names the file."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_entry(path: Path) -> dict:
    """A file's manifest entry (size and sha256), after it is synced to disk."""
    _fsync(path)
    return {"size": path.stat().st_size, "sha256": sha256(path)}


def commit_dir(tmp: Path, final: Path, meta: dict, known: dict[str, dict] | None = None) -> Path:
    """Seal `tmp` with a manifest and rename it to `final` (atomic on one filesystem). `known`: entries
    other processes already took (each rank hashes its own shard); a file whose size differs from
    its known entry is hashed again."""
    files = {}
    for p in sorted(tmp.iterdir()):
        if p.is_file() and p.name != MANIFEST:
            entry = (known or {}).get(p.name)
            files[p.name] = entry if entry and entry["size"] == p.stat().st_size else file_entry(p)
    (tmp / MANIFEST).write_text(json.dumps({**meta, "files": files}, indent=1))
    _fsync(tmp / MANIFEST)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(final.parent)
    return final


def tmp_dir_for(final: Path) -> Path:
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def verify_dir(path: Path, hash_only: set[str] | None = None) -> dict:
    """Return the manifest after checking every file's size and hash; raise naming what is wrong.
    `hash_only`: hash just these files (the rest by size), where ranks share the hashing."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CorruptWeightsError(f"{path}: no {MANIFEST}; the folder is incomplete (interrupted write?)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptWeightsError(f"{manifest_path}: unreadable manifest ({e})") from None
    check_manifest(manifest, manifest_path)
    for name, want in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CorruptWeightsError(f"{f}: listed in the manifest but missing")
        if f.stat().st_size != want["size"]:
            raise CorruptWeightsError(f"{f}: size {f.stat().st_size} != {want['size']} in the manifest (truncated?)")
        if (hash_only is None or name in hash_only) and sha256(f) != want["sha256"]:
            raise CorruptWeightsError(f"{f}: sha256 does not match the manifest (corrupted)")
    return manifest


def check_manifest(manifest, path: Path) -> None:
    """A manifest names plain files of its own folder, each with an integer size and a sha256."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not (files or manifest.get("streamed_only") is True):  # streamed: none
        raise CorruptWeightsError(f"{path}: no 'files' table in the manifest")
    for name, want in files.items():
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name) or name in (".", ".."):
            raise CorruptWeightsError(f"{path}: file name {name!r} is not a plain file of this folder")
        if not (isinstance(want, dict) and isinstance(want.get("size"), int) and isinstance(want.get("sha256"), str)):
            raise CorruptWeightsError(f"{path}: entry for {name!r} needs an integer size and a sha256")


def save_tensors(path: Path, state_dict: dict[str, "torch.Tensor"]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, str(path))


def write_weights(final: Path, state_dict: dict[str, "torch.Tensor"], meta: dict) -> Path:
    tmp = tmp_dir_for(final)
    save_tensors(tmp / WEIGHTS_FILE, state_dict)
    return commit_dir(tmp, final, meta)


STREAMED_ONLY = "[prl: streamed only]"  # in the error a server gives for such a version (not a rejection)


class StreamedOnly(RuntimeError):
    """The version went to the servers by the collective stream only: its sealed folder holds no tensors.
    A server that was not in the stream (restarted meanwhile) takes the next version instead."""


def read_weights(path: Path) -> tuple[dict[str, "torch.Tensor"], dict]:
    """Every tensor of a verified folder: all the safetensors files its manifest lists (one, or one
    per bucket as the trainer publishes)."""
    from safetensors.torch import load_file

    manifest = verify_dir(path)
    if manifest.get("streamed_only"):
        raise StreamedOnly(f"{STREAMED_ONLY} {path}: v{manifest.get('version')} went to the servers by the collective "
                           f"stream only (its folder holds no tensors) and this server did not stage it; it "
                           f"takes the next version, which the trainer writes whole when a server missed the stream")
    state = {}
    for name in sorted(n for n in manifest["files"] if n.endswith(".safetensors")):
        state.update(load_file(str(path / name)))
    return state, manifest


SCREENED = ("float32", "bfloat16", "float16", "float64")  # dtypes whose norms screen a version in one pass


def nonfinite_names(state: dict[str, "torch.Tensor"]) -> list[str]:
    """Names of the floating-point tensors of `state` holding a NaN or an infinity. One foreach norm per device
    screens the common dtypes (a NaN or an infinity makes a tensor's norm non-finite, so a finite norm clears it);
    a tensor whose norm is not finite, and every other floating dtype (FP8), is checked element by element."""
    import torch

    floats = {k: v for k, v in state.items() if v.is_floating_point()}
    suspects = {k for k, v in floats.items() if str(v.dtype).removeprefix("torch.") not in SCREENED}
    by_device: dict = {}
    for k, v in floats.items():
        if k not in suspects:
            by_device.setdefault(v.device, []).append(k)
    for names in by_device.values():
        norms = torch.stack([n.float() for n in torch._foreach_norm([floats[k] for k in names])])
        suspects.update(names[i] for i in (~torch.isfinite(norms)).nonzero()[:, 0].tolist())
    return [k for k in floats if k in suspects and not torch.isfinite(floats[k].float()).all()]


WEIGHTS_PREFIX = "weights_"  # checkpoints/weights_N: weights alone (no optimizer: never resumed from), for eval sets


def sealed(root: Path, prefix: str) -> list[int]:
    """N for every sealed folder `root/{prefix}{N}` (has a manifest), ascending."""
    if not root.is_dir():
        return []
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)$")
    found = []
    for p in root.iterdir():
        m = pattern.match(p.name)
        if m and (p / MANIFEST).is_file():
            found.append(int(m.group(1)))
    return sorted(found)


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version}"


def published_versions(root: Path) -> list[int]:
    return sealed(root, "v")


def adapter_bases(root: Path, versions: list[int]) -> set[int]:
    """The base versions LoRA adapter versions among `versions` apply to (their manifests' `adapter.base`)."""
    bases = set()
    for v in versions:
        try:
            base = json.loads((version_dir(root, v) / MANIFEST).read_text()).get("adapter", {}).get("base")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(base, int):
            bases.add(base)
    return bases


def prune_versions(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` versions and the base any of those is an adapter of (LoRA). Each
    leaves its name first (an atomic rename), so a process stopped mid-way never leaves a sealed folder with
    files missing; leftovers of an earlier interrupted prune go too."""
    versions = published_versions(root)
    pinned = adapter_bases(root, versions[-keep:])
    for v in versions[:-keep]:
        if v in pinned:
            continue
        doomed = root / f".pruned-v{v}-{os.getpid()}"
        try:
            os.rename(version_dir(root, v), doomed)
        except OSError:
            continue  # gone already (another process pruned it)
        shutil.rmtree(doomed, ignore_errors=True)
    for leftover in root.glob(".pruned-v*"):
        shutil.rmtree(leftover, ignore_errors=True)


def latest_checkpoint(root: Path) -> tuple[Path, dict] | None:
    """The newest sealed checkpoint folder `root/step_N` and its manifest (not yet verified)."""
    steps = sealed(root, "step_")
    if not steps:
        return None
    path = root / f"step_{steps[-1]}"
    return path, json.loads((path / MANIFEST).read_text())

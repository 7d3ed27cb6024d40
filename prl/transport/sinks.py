"""How a weight version leaves the trainer: `WeightSink`, the trainer side of a weight path.

`prl.trainer.publish` walks the model's buckets once (one decoder layer each, then the rest); trainer
rank 0 hands each converted bucket to the sink in bucket order, then seals the version. A sink
makes a version visible whole or not at all. A weight path is a sink here plus its server side, a
`WeightSource` in `prl.transport.weights`:
- "folder": `FolderSink` writes the sealed folder `weights/vN` (one safetensors file per bucket,
  `model-00000.safetensors`, ..., MANIFEST.json last, renamed in) and prunes versions beyond `keep`;
  servers read it in place (`SharedFolder`) or download it (`HttpFetch`).
A collective path (gloo/NCCL broadcast from rank 0 into the servers) registers one more kind here
with `@register_sink` and its receiving source beside the others.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING

from prl.model.weights import commit_dir, prune_versions, save_tensors, tmp_dir_for, version_dir

if TYPE_CHECKING:  # tensors only pass through: importing this module needs no torch
    import torch


class WeightSink(abc.ABC):
    """One version at a time, on trainer rank 0: `begin`, `put` each bucket in order, `seal`."""

    kind: str

    @abc.abstractmethod
    def begin(self, version: int, whole: bool = True) -> None:
        """Start version `version` (nothing of it is visible until `seal`). `whole`: its sealed folder
        must hold every tensor (a sink that streams may otherwise seal an empty one once every server
        staged the version)."""

    @abc.abstractmethod
    def put(self, bucket: dict[str, torch.Tensor]) -> None:
        """The next bucket of the version, converted (names and dtypes as the servers take them)."""

    @abc.abstractmethod
    def seal(self, meta: dict) -> Path | None:
        """Make the version visible, whole, with `meta` (version, format); returns where it is, if
        it has a place."""


SINKS: dict[str, type[WeightSink]] = {}


def register_sink(kind: str):
    """Class decorator: the sink built for `weight_sink(kind, ...)`."""
    def register(cls: type[WeightSink]) -> type[WeightSink]:
        cls.kind = kind
        SINKS[kind] = cls
        return cls

    return register


def weight_sink(kind: str, **options) -> WeightSink:
    """A sink of a registered kind, built with its own options (`FolderSink`: root, keep)."""
    if kind not in SINKS:
        raise ValueError(f"weight sink {kind!r}: prl knows {sorted(SINKS)}")
    return SINKS[kind](**options)


@register_sink("folder")
class FolderSink(WeightSink):
    """Sealed version folders under `root`: written under a temporary name, one safetensors file per
    bucket, manifest last, renamed in (`prl.model.weights`); the newest `keep` versions are kept."""

    def __init__(self, root: Path, keep: int):
        self.root, self.keep = Path(root), keep
        self.final: Path | None = None
        self.tmp: Path | None = None
        self.count = 0

    def begin(self, version: int, whole: bool = True) -> None:
        self.final = version_dir(self.root, version)
        self.tmp, self.count = tmp_dir_for(self.final), 0

    def put(self, bucket: dict[str, torch.Tensor]) -> None:
        save_tensors(self.tmp / f"model-{self.count:05d}.safetensors", bucket)
        self.count += 1

    def seal(self, meta: dict) -> Path:
        path = commit_dir(self.tmp, self.final, meta)
        prune_versions(self.root, self.keep)
        self.final = self.tmp = None
        return path

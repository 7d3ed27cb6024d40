"""Rollout transport: how packed batches get from the orchestrator to every trainer rank.

A small abstract class plus one factory keyed on `type`. The filesystem transport writes one
file per step under the run directory (temporary name, then rename: a reader sees a whole batch
or none). A network transport for hosts without shared storage plugs in beside it.
"""

from __future__ import annotations

import abc
import os
import time
from pathlib import Path

import torch

from prl.transport.batch import MicroBatch, TrainBatch


class RolloutTransport(abc.ABC):
    @abc.abstractmethod
    def send(self, batch: TrainBatch) -> None: ...

    @abc.abstractmethod
    def receive(self, step: int, timeout: float | None = None) -> TrainBatch: ...

    @abc.abstractmethod
    def discard_before(self, step: int) -> None: ...


class FilesystemRolloutTransport(RolloutTransport):
    def __init__(self, root: Path, poll_s: float = 0.01):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.poll_s = poll_s

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:06d}.pt"

    def send(self, batch: TrainBatch) -> None:
        final = self.path(batch.step)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        torch.save(batch.to_dict(), tmp)
        os.rename(tmp, final)

    def receive(self, step: int, timeout: float | None = None) -> TrainBatch:
        deadline = None if timeout is None else time.monotonic() + timeout
        path = self.path(step)
        while not path.exists():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no batch for step {step} at {path} after {timeout}s")
            time.sleep(self.poll_s)
        return TrainBatch.from_dict(torch.load(path, weights_only=True))

    def discard_before(self, step: int) -> None:
        for p in self.root.glob("step_*.pt"):
            if int(p.stem.split("_")[1]) < step:
                p.unlink(missing_ok=True)


def make_rollout_transport(kind: str, run_dir: Path) -> RolloutTransport:
    if kind == "filesystem":
        return FilesystemRolloutTransport(Path(run_dir) / "rollouts")
    raise ValueError(f"unknown rollout transport {kind!r}; known: filesystem")


__all__ = ["MicroBatch", "RolloutTransport", "TrainBatch", "make_rollout_transport"]

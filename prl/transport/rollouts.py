"""The batch inbox of trainer rank 0: one file per step under the run directory (temporary name,
then rename: a reader sees a whole batch or none). The orchestrator reaches it over the network
through the trainer endpoint (`prl.transport.endpoint`, client in `prl.transport.trainer_client`);
rank 0 scatters each batch to the other ranks.
"""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path

import torch

from prl.transport.batch import MicroBatch, TrainBatch


class FilesystemRolloutTransport:
    def __init__(self, root: Path, poll_s: float = 0.01):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.poll_s = poll_s

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:06d}.pt"

    def send(self, batch: TrainBatch) -> None:
        self.put_bytes(batch.step, batch_bytes(batch))

    def put_bytes(self, step: int, data: bytes) -> None:
        """Land a serialised batch by rename: a reader sees all of it or nothing."""
        final = self.path(step)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        tmp.write_bytes(data)
        os.rename(tmp, final)

    def receive(self, step: int, timeout: float | None = None) -> TrainBatch:
        deadline = None if timeout is None else time.monotonic() + timeout
        path = self.path(step)
        while not path.exists():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no batch for step {step} at {path} after {timeout}s")
            time.sleep(self.poll_s)
        return TrainBatch.from_dict(torch.load(path, weights_only=True))

    def data_position(self, step: int) -> tuple[int, list[int]]:
        """The batch's data cursor: (position, indices at or past it already consumed)."""
        d = torch.load(self.path(step), weights_only=True)
        return int(d["data_position"]), [int(i) for i in d.get("data_ahead", [])]

    def discard_before(self, step: int) -> None:
        for p in self.root.glob("step_*.pt"):
            if int(p.stem.split("_")[1]) < step:
                p.unlink(missing_ok=True)


def batch_bytes(batch: TrainBatch) -> bytes:
    buf = io.BytesIO()
    torch.save(batch.to_dict(), buf)
    return buf.getvalue()


__all__ = ["FilesystemRolloutTransport", "MicroBatch", "TrainBatch", "batch_bytes"]

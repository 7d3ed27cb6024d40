"""Read the records of an offline W&B run file (`run-ID.wandb`), so tests check what W&B would
upload, not only that a file exists. The file is W&B's header (":W&B", magic, version: 7 bytes) then
LevelDB's log format: 32 KiB blocks of chunks (crc32c 4, length 2, type 1: full/first/middle/last)
whose payloads, joined, are `wandb_internal_pb2.Record` messages."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    pos, payload = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        payload += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (FULL, LAST):
            r = pb.Record()
            r.ParseFromString(payload)
            payload = b""
            yield r


def history(path: Path) -> list[dict]:
    """The logged rows, keys joined as W&B shows them ("orchestrator/reward")."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
    return rows


def config(path: Path) -> dict:
    """The run's config: the run record's, then later config updates."""
    out = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind in ("run", "config"):
            items = r.run.config.update if kind == "run" else r.config.update
            out.update({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items})
    return out


def run_id(path: Path) -> str:
    for r in records(path):
        if r.WhichOneof("record_type") == "run":
            return r.run.run_id
    raise AssertionError(f"{path}: no run record")


def finished_files(run_dir: Path, count: int = 1, timeout_s: float = 120) -> list[Path]:
    """The run's offline files (oldest first) once each holds its exit record: W&B's service process writes
    the file and may still be writing when `finish()` returns in the caller."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
        done = [f for f in files if any(r.WhichOneof("record_type") == "exit" for r in records(f))]
        if len(done) >= count or time.monotonic() > deadline:
            assert len(done) >= count, f"{run_dir}: {len(done)} of {count} W&B run files finished ({files})"
            return done
        time.sleep(0.2)

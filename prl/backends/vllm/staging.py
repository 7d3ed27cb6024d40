"""Staging a weights version off vLLM's engine loop, and the status the client polls.

vLLM runs every weight RPC inside its engine loop, so work done in an RPC stops decoding. prl's
plugin therefore only *starts* staging in the `stage` RPC: a thread fetches, verifies, reads and
checks version N while decoding goes on, and writes its state to a status file per worker rank
(`{run}/weights/.staging/{server}/rank{r}.json`, replaced atomically). prl's middleware in vLLM's API
server (same host) answers `GET /prl/staged` from those files, so the client waits for "ready"
without touching the engine loop, and pauses only for the load proper.

Versions race (the trainer streams vN+1 into the workers before the orchestrator asked for vN): a
worker keeps the two newest versions it received and the one the orchestrator asked to stage
(pinned by the `stage` RPC), so a receive never drops the version about to be loaded. The status names the newest
version staged whole on every rank; the client loads that one when it is newer than the one asked
(newer weights are always acceptable in async RL: each token is labelled with the version that
produced it), else the one asked. A version is loaded only once every rank staged it, and every
rank loads the one the client names: workers never choose.

No vLLM import here: the API server's middleware reads the status without loading the plugin.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

KEEP = 2  # the newest versions a worker keeps staged, besides the one asked for (each a copy of its weights)


def status_dir(cfg) -> Path:
    return cfg.run_path / "weights" / ".staging" / cfg.name


def write_status(folder: Path, rank: int, status: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(status))
    os.replace(tmp, folder / f"rank{rank}.json")


def read_status(folder: Path, version: int) -> dict:
    """`{"state": "staging" | "ready" | "failed", "error": ..., "newest": M | None}` of `version` over
    every rank; "newest": the newest version after `version` that every rank staged whole."""
    ranks = []
    for p in sorted(folder.glob("rank*.json")) if folder.is_dir() else []:
        try:
            ranks.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            return {"state": "staging", "error": None, "newest": None}
    world = max((r.get("world", 1) for r in ranks), default=1)
    whole = len(ranks) >= world

    def on_ranks(v: int) -> list[dict | None]:
        return [r["versions"].get(str(v)) or ({"state": "ready", "error": None} if r.get("served") == v else None)
                for r in ranks]

    def all_ready(v: int) -> bool:
        return whole and all(x is not None and x["state"] == "ready" for x in on_ranks(v))

    later = {int(v) for r in ranks for v in r["versions"] if int(v) > version}
    newest = max((v for v in later if all_ready(v)), default=None)
    failed = [x for x in on_ranks(version) if x is not None and x["state"] == "failed"]
    if failed:
        return {"state": "failed", "error": failed[0]["error"], "newest": newest}
    return {"state": "ready" if all_ready(version) else "staging", "error": None, "newest": newest}


@dataclass
class Slot:
    """One version being staged (`thread` alive) or staged (`state`), or failed (`error`)."""

    thread: threading.Thread | None = None
    state: dict | None = None
    error: BaseException | None = None


class Stager:
    """The `KEEP` newest versions and the pinned one (a slot still being read is kept until it ends):
    `start(v)` reads v on a thread; `result(v)` waits for it and returns the tensors or raises
    what went wrong."""

    def __init__(self, read: Callable[[int], dict], folder: Path, rank: int = 0, world: int = 1):
        self.read, self.folder, self.rank, self.world = read, folder, rank, world
        self.slots: dict[int, Slot] = {}
        self.pinned: int | None = None  # the version the orchestrator asked to stage
        self.served: int | None = None  # reported ready without staging (the version the worker serves)
        self.lock = threading.Lock()  # slots and the status file, from the RPC thread and the stage threads
        self.clear_status()

    def clear_status(self) -> None:
        """A (re)started worker holds nothing: its rank's file goes, and rank 0 removes files of ranks
        beyond this server's workers (left by an earlier server with more)."""
        for p in self.folder.glob("rank*.json") if self.folder.is_dir() else []:
            r = p.stem.removeprefix("rank")
            if r == str(self.rank) or (self.rank == 0 and r.isdigit() and int(r) >= self.world):
                p.unlink(missing_ok=True)

    def start(self, version: int, read: Callable[[int], dict] | None = None, pin: bool = False) -> None:
        """Stage `version` with `read` (default: the folder's); one already staging or staged is kept
        (e.g. staged from the collective weight path before the orchestrator asked for it). `pin`: the
        orchestrator asked for it (kept until loaded or another is pinned)."""
        with self.lock:
            if pin:
                self.pinned = version
            slot = self.slots.get(version)
            if slot is None or slot.error is not None:
                slot = self.slots[version] = Slot()
                slot.thread = threading.Thread(target=self._run, args=(slot, version, read or self.read),
                                               name=f"prl-stage-v{version}", daemon=True)
                slot.thread.start()
            self._evict()
            self._write()

    def holds(self, version: int) -> bool:
        """Whether `version` is staging or staged (not failed)."""
        slot = self.slots.get(version)
        return slot is not None and slot.error is None

    def already(self, version: int) -> None:
        """`version` is the one served: nothing to stage or load; reported ready."""
        with self.lock:
            self.served, self.pinned = version, None
            self._evict()
            self._write()

    def _run(self, slot: Slot, version: int, read: Callable[[int], dict]) -> None:
        try:
            slot.state = read(version)
        except BaseException as e:  # noqa: BLE001 - reported through the status file and by result()
            slot.error = e
        with self.lock:
            self._write()

    def _evict(self) -> None:
        """Keep the `KEEP` newest versions, the pinned one, and any still being read."""
        keep = set(sorted(self.slots)[-KEEP:]) | {self.pinned}
        for v in [v for v, s in self.slots.items() if v not in keep and not s.thread.is_alive()]:
            del self.slots[v]

    def _write(self) -> None:
        versions = {str(v): {"state": "failed" if s.error is not None else "ready" if s.state is not None
                             else "staging", "error": None if s.error is None else f"{type(s.error).__name__}: {s.error}"}
                    for v, s in self.slots.items()}
        write_status(self.folder, self.rank, {"world": self.world, "served": self.served, "versions": versions})

    def result(self, version: int) -> dict:
        """The staged tensors of `version` (staged now from the folder if it is not held); then it and
        every older version are let go."""
        if not self.holds(version):
            self.start(version)
        slot = self.slots[version]
        slot.thread.join()
        if slot.error is not None:
            raise slot.error
        with self.lock:
            for v in [v for v, s in self.slots.items() if v <= version and not s.thread.is_alive()]:
                del self.slots[v]
            self.pinned = None if self.pinned is not None and self.pinned <= version else self.pinned
            self.served = version
            self._write()
        return slot.state

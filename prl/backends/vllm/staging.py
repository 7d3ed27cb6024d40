"""Staging a weights version off vLLM's engine loop, and the status the client polls.

vLLM runs every weight RPC inside its engine loop, so work done in an RPC stops decoding. prl's
plugin therefore only *starts* staging in the `stage` RPC: a thread fetches, verifies, reads and
checks version N while decoding goes on, and writes its state to a status file per worker rank
(`{run}/weights/.staging/{server}/rank{r}.json`, replaced atomically). prl's middleware in vLLM's API
server (same host) answers `GET /prl/staged` from those files, so the client waits for "ready"
without touching the engine loop, and pauses only for the load proper.

Versions race (the trainer streams vN+1 into the workers before the orchestrator asked for vN): a
worker keeps the newest version it holds. Asked to stage an older one, it keeps the newer (the
status then answers "newer", naming it, and the client stages and loads that one instead); asked
to load an older one, it refuses before touching the model with `SUPERSEDED` and the newer version,
and the client resumes and loads the newer. Newer weights are always acceptable in async RL: every
token is labelled with the version that produced it. Every worker of a server sees the same
sequence of RPCs (vLLM hands each to all workers in order), so they agree on the newest version.

No vLLM import here: the API server's middleware reads the status without loading the plugin.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Callable

SUPERSEDED = "[prl: superseded]"  # a worker's answer to a load of vN while it holds a newer version


class Superseded(RuntimeError):
    """The worker holds `newer` (staged or staging): the older version asked for is skipped."""

    def __init__(self, asked: int, newer: int):
        super().__init__(f"{SUPERSEDED} v{newer} is staged, newer than v{asked}: v{asked} is skipped on this server")
        self.newer = newer


def superseded_by(text: str) -> int | None:
    """The newer version a `SUPERSEDED` answer names, None if `text` is no such answer."""
    m = re.search(re.escape(SUPERSEDED) + r" v(\d+)", text)
    return int(m.group(1)) if m else None


def status_dir(cfg) -> Path:
    return cfg.run_path / "weights" / ".staging" / cfg.name


def write_status(folder: Path, rank: int, world: int, version: int, state: str, error: str | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps({"version": version, "state": state, "error": error, "world": world}))
    os.replace(tmp, folder / f"rank{rank}.json")


def read_status(folder: Path, version: int) -> dict:
    """`{"state": "staging" | "ready" | "failed" | "newer", "error": ..., "version": ...}` of `version`
    over every rank; "newer": a rank holds a newer version (not failed), named by "version"."""
    ranks = []
    for p in sorted(folder.glob("rank*.json")) if folder.is_dir() else []:
        try:
            ranks.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            return {"state": "staging", "error": None}
    newer = [r["version"] for r in ranks if r.get("version", -1) > version and r.get("state") != "failed"]
    if newer:
        return {"state": "newer", "error": None, "version": max(newer)}
    mine = [r for r in ranks if r.get("version") == version]
    failed = [r for r in mine if r.get("state") == "failed"]
    if failed:
        return {"state": "failed", "error": failed[0].get("error")}
    world = max((r.get("world", 1) for r in mine), default=1)
    ready = len(mine) >= world and all(r.get("state") == "ready" for r in mine)
    return {"state": "ready" if ready and mine else "staging", "error": None}


class Stager:
    """One version at a time, the newest: `start(v)` reads v on a thread; `result(v)` waits for it and
    returns the tensors or raises what went wrong (`Superseded` when a newer one came meanwhile)."""

    def __init__(self, read: Callable[[int], dict], folder: Path, rank: int = 0, world: int = 1):
        self.read, self.folder, self.rank, self.world = read, folder, rank, world
        self.version: int | None = None
        self.thread: threading.Thread | None = None
        self.state: dict | None = None
        self.error: BaseException | None = None

    def start(self, version: int, read: Callable[[int], dict] | None = None) -> None:
        """Stage `version` with `read` (default: the folder's); one already staging or staged is kept
        (e.g. staged from the collective weight path before the orchestrator asked for it)."""
        if self.holds(version):
            return  # already staging or staged, or a newer one (came by the stream first): kept
        if self.thread is not None:
            self.thread.join()
        self.version, self.state, self.error = version, None, None
        write_status(self.folder, self.rank, self.world, version, "staging")
        self.thread = threading.Thread(target=self._run, args=(version, read or self.read),
                                       name=f"prl-stage-v{version}", daemon=True)
        self.thread.start()

    def holds(self, version: int) -> bool:
        """Whether `version` or a newer one is staging or staged (not failed)."""
        return self.version is not None and self.version >= version and self.error is None

    def already(self, version: int) -> None:
        """`version` is the one served: nothing to stage or load; reported ready."""
        self.version = self.state = self.thread = None
        self.error = None
        write_status(self.folder, self.rank, self.world, version, "ready")

    def _run(self, version: int, read: Callable[[int], dict]) -> None:
        try:
            self.state = read(version)
            write_status(self.folder, self.rank, self.world, version, "ready")
        except BaseException as e:  # noqa: BLE001 - reported through the status file and by result()
            self.error = e
            write_status(self.folder, self.rank, self.world, version, "failed", f"{type(e).__name__}: {e}")

    def result(self, version: int) -> dict:
        if self.holds(version + 1):
            raise Superseded(version, self.version)
        if self.version != version:
            self.start(version)
        self.thread.join()
        if self.error is not None:
            raise self.error
        state, self.state, self.version, self.thread = self.state, None, None, None
        return state

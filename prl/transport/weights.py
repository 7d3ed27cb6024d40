"""How a weight version reaches an inference server: `WeightSource.fetch(version) -> local folder`.

- `SharedFolder`: the server shares the trainer's filesystem (same host): the sealed `weights/vN`.
- `HttpFetch`: another host. The server downloads the manifest and files of vN from the trainer
  endpoint into a temporary folder on its own host, verifies every size and sha256, and renames it
  to `weights/vN`: a per-host copy is whole or absent, and servers on one host share it. A failed
  transfer is retried; after the last attempt the server answers 409 and keeps serving its version.

The GPU path (the GPU backend issue) adds a third source behind the same call: trainer rank 0 and
every inference rank join one NCCL group at start; to publish vN, rank 0 broadcasts each tensor
(bucketed, in manifest order) and each server receives into staging buffers of known shapes,
then swaps them in between decode steps, exactly as a fetched folder is swapped in today. The
version number and the manifest (names, shapes, dtypes) still travel over this endpoint, so the
orchestrator's relay and the "never half-loaded" rule do not change.
"""

from __future__ import annotations

import abc
import json
import os
import shutil
import time
from pathlib import Path

import httpx

from prl.model.weights import (
    MANIFEST,
    CorruptWeightsError,
    prune_versions,
    verify_dir,
    version_dir,
)


class WeightFetchError(RuntimeError):
    pass


class WeightSource(abc.ABC):
    @abc.abstractmethod
    def fetch(self, version: int) -> Path: ...


class SharedFolder(WeightSource):
    def __init__(self, root: Path):
        self.root = Path(root)

    def fetch(self, version: int) -> Path:
        return version_dir(self.root, version)


class HttpFetch(WeightSource):
    def __init__(self, base_url: str, secret: str, root: Path, keep: int = 3, attempts: int = 3):
        self.base_url, self.root, self.keep, self.attempts = base_url, Path(root), keep, attempts
        self.headers = {"Authorization": f"Bearer {secret}"}

    def fetch(self, version: int) -> Path:
        final = version_dir(self.root, version)
        errors = []
        for attempt in range(self.attempts):
            if (final / MANIFEST).is_file():  # already here (another server on this host fetched it)
                return final
            try:
                self._download(version, final)
                prune_versions(self.root, self.keep)
                return final
            except (httpx.HTTPError, OSError, CorruptWeightsError, ValueError) as e:
                errors.append(f"attempt {attempt + 1}: {type(e).__name__}: {e}")
                time.sleep(0.2 * (attempt + 1))
        raise WeightFetchError(f"v{version} from {self.base_url}: " + "; ".join(errors))

    def _download(self, version: int, final: Path) -> None:
        tmp = final.with_name(f".{final.name}.fetch-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            with httpx.Client(base_url=self.base_url, headers=self.headers, timeout=httpx.Timeout(600, connect=10)) as c:
                manifest = self._get(c, version, MANIFEST, tmp)
                for name in json.loads(manifest.read_text())["files"]:
                    self._get(c, version, name, tmp)
            verify_dir(tmp)
            try:
                os.rename(tmp, final)
            except OSError:  # another server on this host sealed it first: use theirs
                if not (final / MANIFEST).is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def _get(client: httpx.Client, version: int, name: str, folder: Path) -> Path:
        path = folder / name
        with client.stream("GET", f"/weights/v{version}/{name}") as r:
            r.raise_for_status()
            with open(path, "wb") as f:
                f.writelines(r.iter_bytes(1 << 20))
        return path


def weight_source(cfg) -> WeightSource:
    """Where an inference server (a `ProcessConfig`) reads published versions: in place on the
    trainer's host, else downloaded and verified from the trainer endpoint."""
    root = cfg.run_path / "weights"
    if cfg.shares_trainer_fs:
        return SharedFolder(root)
    return HttpFetch(cfg.trainer_url, cfg.secret(), root, keep=cfg.keep_weights)

"""Resolution: a validated recipe plus launch facts (ports, paths, secret) -> one config per process.

This is the one place where values are derived; the schema validators never rewrite a recipe.
"""

from __future__ import annotations

import json
import secrets
import socket
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from prl.recipe.schema import Recipe


class ProcessConfig(BaseModel):
    """What one process needs: the whole resolved recipe and its own place in the run."""

    model_config = ConfigDict(extra="forbid")

    name: str
    role: Literal["inference", "orchestrator", "trainer", "kv_master"]
    run_dir: str
    recipe: Recipe
    secret_file: str
    host: str = "127.0.0.1"
    port: int = 0
    servers: list[str] = []  # inference base URLs, for the orchestrator
    prefill_servers: list[int] = []  # P/D: indices of the servers that only prefill into the KV pool
    index: int = 0
    trainer_url: str = ""  # the trainer endpoint on rank 0 (rollouts in, weights out)
    trainer_world: int = 1  # trainer ranks over all trainer hosts (the orchestrator packs for them)
    shares_trainer_fs: bool = True  # an inference server on the trainer's host reads weights in place
    node: str = "local"  # the host it runs on (a cluster host name, "workstation" or "local")
    gpus: list[int] = []  # GPU indices on its host (inference servers on GPU hosts)
    kv_master: dict = {}  # the KV pool's master (prl.inference.kv_master.MasterAddress fields), if any

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    @property
    def model_dir(self) -> Path:
        return self.run_path / "model"

    def secret(self) -> str:
        return Path(self.secret_file).read_text().strip()


def load_process_config(path: str | Path) -> ProcessConfig:
    return ProcessConfig.model_validate_json(Path(path).read_text())


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def write_secret(run_dir: Path) -> Path:
    path = run_dir / "secret"
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(32))
    return path


def resolve(recipe: Recipe, run_dir: Path, secret_file: Path) -> list[ProcessConfig]:
    """One ProcessConfig per process: the inference servers, the orchestrator, the trainer."""
    inf = recipe.inference
    ports = [inf.port + i if inf.port else free_port(inf.host) for i in range(inf.num_servers)]
    common = dict(run_dir=str(run_dir), recipe=recipe, secret_file=str(secret_file))
    servers = [
        ProcessConfig(name=f"inference-{i}", role="inference", host=inf.host, port=p, index=i, **common)
        for i, p in enumerate(ports)
    ]
    urls = [f"http://{s.host}:{s.port}" for s in servers]
    trainer = ProcessConfig(name="trainer", role="trainer", host=inf.host, port=free_port(inf.host),
                            trainer_world=recipe.trainer.nproc, **common)
    trainer_url = f"http://{trainer.host}:{trainer.port}"
    for c in servers:
        c.trainer_url = trainer_url
    pool = kv_master_config(recipe, inf.host, common, servers)
    return [
        *pool,
        *servers,
        ProcessConfig(name="orchestrator", role="orchestrator", servers=urls, trainer_url=trainer_url,
                      trainer_world=recipe.trainer.nproc, prefill_servers=list(range(inf.prefill_servers)), **common),
        trainer,
    ]


def kv_master_config(recipe: Recipe, host: str, common: dict, servers: list[ProcessConfig]) -> list[ProcessConfig]:
    """With `inference.kv_pool`, the `kv-master` process on `host`, and its address told to every
    server (free ports unless the recipe fixes them)."""
    if not recipe.inference.kv_pool.enabled:
        return []
    base = recipe.inference.kv_pool.port
    ports = (base, base + 1, base + 2) if base else (free_port(host), free_port(host), free_port(host))
    addr = attach_kv_master(host, ports, servers)
    return [ProcessConfig(name="kv-master", role="kv_master", host=host, port=ports[0], kv_master=addr, **common)]


def attach_kv_master(host: str, ports: tuple[int, int, int], servers: list[ProcessConfig]) -> dict:
    """The KV-pool master's address (rpc, metadata and metrics ports on `host`), told to every server."""
    addr = {"host": host, "rpc_port": ports[0], "metadata_port": ports[1], "metrics_port": ports[2]}
    for s in servers:
        s.kv_master = addr
    return addr


def write_configs(configs: list[ProcessConfig], run_dir: Path) -> dict[str, Path]:
    out = run_dir / "config"
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for c in configs:
        paths[c.name] = out / f"{c.name}.json"
        paths[c.name].write_text(json.dumps(c.model_dump(), indent=1))
    return paths

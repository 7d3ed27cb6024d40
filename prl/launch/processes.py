"""The process plan: which process runs where, with which command. Printed by `--dry-run`."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prl.backends import registry
from prl.recipe.resolve import ProcessConfig
from prl.recipe.roles import TrainerConfig
from prl.recipe.schema import Recipe

# no process ever downloads: models, tokenizers and data come from the run directory
BASE_ENV = {
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
SHOWN_ENV = ("OMP", "PRL", "CUDA_VISIBLE")


@dataclass
class ProcessSpec:
    name: str
    role: str
    host: str  # the host it runs on ("local" for a run on this machine)
    cmd: list[str]
    log: Path  # the log on the workstation (streamed back from remote hosts)
    env: dict[str, str] = field(default_factory=dict)
    host_log: str = ""  # the log on its own host (== log for a local run)
    run_dir: str = ""  # the run directory on its own host
    unit: str = ""  # restarted together with the processes of this unit (a multi-host engine: its leader's name)

    def command_line(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items() if k.startswith(SHOWN_ENV))
        return (env + " " if env else "") + shlex.join(self.cmd)


def trainer_command(cfg: TrainerConfig, python: str) -> list[str]:
    """One rank on one host runs as the process itself (`prl.trainer` sets up its one-rank group): torchrun's agent
    would add about 2 s of imports before the rank starts and a second after it ends, at every start and restart."""
    entry = ["-m", "prl.trainer", "--config", cfg.config_path]
    if cfg.trainer.nproc == 1 and not cfg.rendezvous:
        return [python, *entry, "--alone"]
    run = [python, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.trainer.nproc}"]
    if not cfg.rendezvous:
        run.append("--standalone")
    else:
        address, _, port = cfg.rendezvous.rpartition(":")
        run += [f"--nnodes={cfg.nnodes}", f"--node-rank={cfg.index}", f"--master-addr={address}",
                f"--master-port={port}"]
    return [*run, *entry]


def process_command(cfg: ProcessConfig, python: str = sys.executable) -> list[str]:
    if cfg.role == "trainer":
        return trainer_command(cfg, python)
    if cfg.role == "kv_master":
        from prl.inference.kv_master import launch_command

        return launch_command(cfg, python)
    if cfg.role == "reward_model":
        return [python, "-m", "prl.inference.reward_model", "--config", cfg.config_path]
    if cfg.role in ("inference", "engine_worker"):
        command = registry.get(cfg.inference.backend).launch_command(cfg, python)
        if command is not None:
            return command
    return [python, "-m", f"prl.{cfg.role}", "--config", cfg.config_path]


def make_plan(configs: list[ProcessConfig], run_dir: Path,
              python_for: Callable[[str], str] = lambda node: sys.executable) -> list[ProcessSpec]:
    """`python_for(node)`: the interpreter on that host (the run's venv on cluster hosts)."""
    specs = []
    for cfg in configs:
        env = {**BASE_ENV, "OMP_NUM_THREADS": str(cfg.threads), "PRL_RUN_DIR": cfg.run_dir, **cfg.process_env}
        if cfg.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cfg.gpus))
        specs.append(ProcessSpec(
            name=cfg.name, role=cfg.role, host=cfg.node, cmd=process_command(cfg, python_for(cfg.node)),
            log=run_dir / "logs" / f"{cfg.name}.log", env=env, host_log=f"{cfg.run_dir}/logs/{cfg.name}.log",
            run_dir=cfg.run_dir, unit=cfg.engine if cfg.role == "engine_worker" else "",
        ))
    return specs


def format_plan(specs: list[ProcessSpec], recipe: Recipe | None = None) -> str:
    hosts = list(dict.fromkeys(s.host for s in specs))
    lines = [f"process plan: {len(specs)} processes on {len(hosts)} host(s)"]
    for s in specs:
        lines.append(f"  {s.name:<14} role={s.role:<12} host={s.host}")
        lines.append(f"      {s.command_line()}")
        lines.append(f"      log: {s.host_log}" + (f" (streamed to {s.log})" if s.host_log != str(s.log) else ""))
    if recipe is not None and recipe.cluster is not None:
        engines = sum(s.role == "inference" for s in specs)
        hosts = engines + sum(s.role == "engine_worker" for s in specs)
        path = recipe.trainer.weight_transfer
        senders = f"all {recipe.trainer_world()} trainer ranks" if path == "stream" else "trainer rank 0"
        how = ("the sealed folder, over HTTP" if path == "folder" else
               "streamed (NCCL where every member holds a GPU, else gloo; the sealed folder the fallback)")
        lines.append(f"weights: {senders} -> {engines} inference server(s) on {hosts} host(s), {how}")
    return "\n".join(lines)

"""The process plan: which process runs where, with which command. Printed by `--dry-run`."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from prl.recipe.resolve import ProcessConfig

# no process ever downloads: models, tokenizers and data come from the run directory
BASE_ENV = {
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


@dataclass
class ProcessSpec:
    name: str
    role: str
    host: str
    cmd: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)

    def command_line(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items() if k.startswith(("OMP", "PRL")))
        return (env + " " if env else "") + shlex.join(self.cmd)


def process_command(cfg: ProcessConfig, config_path: Path, python: str = sys.executable) -> list[str]:
    if cfg.role == "trainer":
        nproc = cfg.recipe.trainer.nproc
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "-m", "prl.trainer", "--config", str(config_path)]
    return [python, "-m", f"prl.{cfg.role}", "--config", str(config_path)]


def threads_for(cfg: ProcessConfig) -> int:
    r = cfg.recipe
    return {"trainer": r.trainer.threads, "inference": r.inference.threads}.get(cfg.role, 1)


def make_plan(configs: list[ProcessConfig], config_paths: dict[str, Path], run_dir: Path) -> list[ProcessSpec]:
    specs = []
    for cfg in configs:
        env = {**BASE_ENV, "OMP_NUM_THREADS": str(threads_for(cfg)), "PRL_RUN_DIR": str(run_dir)}
        specs.append(ProcessSpec(
            name=cfg.name, role=cfg.role, host="localhost",
            cmd=process_command(cfg, config_paths[cfg.name]), log=run_dir / "logs" / f"{cfg.name}.log", env=env,
        ))
    return specs


def format_plan(specs: list[ProcessSpec]) -> str:
    lines = ["process plan:"]
    for s in specs:
        lines.append(f"  {s.name:<14} role={s.role:<12} host={s.host}")
        lines.append(f"      {s.command_line()}")
        lines.append(f"      log: {s.log}")
    return "\n".join(lines)

"""One typed config per process role: each process gets the recipe sections it needs and the values
derived for it (`prl.recipe.resolve` builds them), nothing else. A role that reads another role's
section fails: the attribute does not exist.

| role | sections | derived for it |
| --- | --- | --- |
| inference | run, inference | router_replay, keep_weights, weight_transfer, pretrained, trainer_url, kv_master |
| orchestrator | run, rl, sampling, task, env, eval | backend, servers, prefill_servers, data_parallel, micro_batch_tokens, share_prompts, ... |
| trainer | run, model, task, env, sft, rl, sampling, trainer | eval_points, await_orchestrator, publish_format, publish_fp8, shared_checkpoints, torchrun layout, servers (collective weights) |
| engine_worker | as inference | its engine's leader, its first data-parallel rank |
| kv_master | run, kv_pool | its address |
| sandbox | run, sandbox (env.sandbox) | its address |
| reward_model | run, reward.model | its address |
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from prl.recipe.schema import (
    EnvCfg,
    EvalCfg,
    InferenceCfg,
    KvPoolCfg,
    ModelCfg,
    RlCfg,
    RunCfg,
    SamplingCfg,
    RewardCfg,
    RewardModelCfg,
    SandboxCfg,
    SftCfg,
    TaskCfg,
    TeacherCfg,
    TrainerCfg,
)


class RoleConfig(BaseModel):
    """What every process has: its name and place in the run."""

    model_config = ConfigDict(extra="forbid")

    name: str
    run_dir: str  # the run directory on its own host
    secret_file: str
    run: RunCfg
    host: str = "127.0.0.1"  # the address it binds (listening roles)
    port: int = 0
    # one machine, port chosen by prl: bind another free port if this one is taken, and publish
    # the port got in RUN_DIR/ports (prl.transport.ports); configured ports are used as given
    port_fallback: bool = False
    index: int = 0
    node: str = "local"  # the host it runs on (a cluster host name, "workstation" or "local")
    threads: int = 1  # OMP threads
    process_env: dict[str, str] = {}  # extra environment variables (cluster.env)
    gpus: list[int] = []  # GPU indices on its host

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    @property
    def model_dir(self) -> Path:
        return self.run_path / "model"

    @property
    def config_path(self) -> str:
        return f"{self.run_dir}/config/{self.name}.json"

    def secret(self) -> str:
        return Path(self.secret_file).read_text().strip()


class ServerConfig(RoleConfig):
    role: Literal["inference"] = "inference"
    inference: InferenceCfg
    router_replay: bool = False  # capture routed experts (R3)
    pretrained: bool = False  # model.path set: the folder's weights are the start (else version 0 arrives first)
    keep_weights: int = 3  # weight versions kept on a host that downloads them
    weight_transfer: str = "http"
    trainer_url: str = ""  # weights are downloaded from there by servers on other hosts
    shares_trainer_fs: bool = True  # a server on the trainer's host reads weights in place
    kv_master: dict = {}  # the KV pool's master (prl.inference.kv_master.MasterAddress fields), if any
    engine_rpc: str = ""  # inference.hosts_per_engine > 1: "address:port" of the engine's data-parallel RPC (its leader)
    model_folder: str = ""  # a teacher's: the frozen model it serves (else the run's model folder)

    @property
    def model_dir(self) -> Path:
        return Path(self.model_folder) if self.model_folder else self.run_path / "model"

    def engine_rpc_address(self) -> tuple[str, int]:
        """(address, port) of `engine_rpc`."""
        host, _, port = self.engine_rpc.rpartition(":")
        return host, int(port)


class EngineWorkerConfig(ServerConfig):
    """A host of a multi-host engine (`inference.hosts_per_engine`) other than its leader: the engine's
    data-parallel ranks `start_rank`.. on this host, headless, joined to the leader's RPC port. It and
    its leader are one unit: either dies, both restart."""

    role: Literal["engine_worker"] = "engine_worker"
    engine: str  # the leader's name
    start_rank: int


class OrchestratorConfig(RoleConfig):
    role: Literal["orchestrator"] = "orchestrator"
    rl: RlCfg
    sampling: SamplingCfg
    task: TaskCfg
    env: EnvCfg
    eval: dict[str, EvalCfg] = {}  # the held-out sets it scores during the run
    training_reach: int = 0  # example indices training can take (`Recipe.training_reach`)
    warm_start_examples: int = 0  # demonstrations the trainer's warm start draws (sft steps x batch size)
    sft: SftCfg | None = None  # the recipe's [sft] where the warm start reads a file (its prompts are training's)
    backend: str = "embedded"
    startup_timeout_s: int = 600
    router_replay: bool = False  # ask the servers for routed experts
    servers: list[str] = []  # inference base URLs
    prefill_servers: list[int] = []  # P/D: indices of the servers that only prefill into the KV pool
    trainer_url: str = ""
    sandboxes: list[str] = []  # an environment that needs the sandbox: the sandbox workers' base URLs
    data_parallel: int = 1  # trainer ranks that take their own micro-batches (packed for them)
    micro_batch_tokens: int = 4096
    share_prompts: bool = False  # pack a group's members over one copy of their prompt (trainer.share_prompts)
    draft_weights: bool = False  # vLLM MTP on dummy-started (FP8) servers: load the drafter after the first version
    teacher: TeacherCfg | None = None  # on-policy distillation: how the teacher's logprobs enter the advantages
    teachers: list[str] = []  # the teacher's servers' base URLs
    reward: RewardCfg = RewardCfg()  # how a reward model's score enters each sample's reward
    reward_models: list[str] = []  # the reward model's servers' base URLs
    judges: list[str] = []  # the judge's servers' base URLs, where the run serves it (reward.judge.path)


class TrainerConfig(RoleConfig):
    role: Literal["trainer"] = "trainer"
    model: ModelCfg
    task: TaskCfg
    env: EnvCfg
    sft: SftCfg
    rl: RlCfg
    sampling: SamplingCfg
    trainer: TrainerCfg
    publish_format: str = "memory"  # what the servers' backend reads ("memory" | "hf")
    publish_fp8: bool = False  # the servers compute in FP8: publish those weights block-FP8
    shared_checkpoints: str | None = None
    world: int = 1  # ranks over all trainer hosts
    nnodes: int = 1  # trainer hosts (torchrun nodes); this one is node `index`
    rendezvous: str = ""  # "address:port" of node 0 (empty: one host, --standalone)
    servers: list[str] = []  # trainer.weight_transfer = "collective": the inference servers' base URLs
    eval_points: list[int] = []  # steps whose weights an eval set scores: checkpointed, so `prl eval` can score them again
    await_orchestrator: bool = False  # eval sets run: keep the endpoint up until the orchestrator has logged them all
    teacher_kl_coef: float = 0.0  # teacher.mode = "loss": the weight of the KL to the teacher in the loss
    teacher_kl_estimator: str = "k2"  # teacher.mode = "loss": its per-token estimate (teacher.kl_estimator)


class KvMasterConfig(RoleConfig):
    role: Literal["kv_master"] = "kv_master"
    kv_pool: KvPoolCfg
    kv_master: dict = {}


class SandboxConfig(RoleConfig):
    role: Literal["sandbox"] = "sandbox"
    sandbox: SandboxCfg


class RewardModelConfig(RoleConfig):
    """A server of the run's reward model (`[reward.model]`): a frozen sequence-classification folder."""

    role: Literal["reward_model"] = "reward_model"
    reward_model: RewardModelCfg


ProcessConfig = Annotated[Union[ServerConfig, EngineWorkerConfig, OrchestratorConfig, TrainerConfig, KvMasterConfig,
                                SandboxConfig, RewardModelConfig],
                          Field(discriminator="role")]
_ADAPTER = TypeAdapter(ProcessConfig)


def load_process_config(path: str | Path) -> ProcessConfig:
    return _ADAPTER.validate_json(Path(path).read_text())

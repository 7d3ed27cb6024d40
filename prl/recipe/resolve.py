"""Resolution: a validated recipe plus launch facts -> one typed config per process (`prl.recipe.roles`).

The one place where values are derived (the schema validators never rewrite a recipe), for one
machine and a cluster alike. A machine without `[cluster]` is laid out as a cluster of one host:

- servers: `inference.num_servers` on this machine at `inference.host`; on a cluster,
  `gpus // gpus_per_server` per `placement.inference` host (one on a CPU host), ports counting up
  from `cluster.inference_port`, numbered in placement order;
- P/D: `inference.prefill_servers = N`, the first N servers prefill only (on a cluster: list the
  prefill hosts first in `placement.inference`);
- trainer: one torchrun on this machine, or one per `placement.trainer` host (`trainer.nproc` ranks
  each); node 0 runs the trainer endpoint and the rendezvous;
- the orchestrator beside trainer node 0 (or `placement.orchestrator`); the KV pool's master
  (`inference.kv_pool`) beside the first server (or `inference.kv_pool.host`);
- sandbox workers (an environment class that declares `needs_sandbox`, e.g. `env.kind = "code"`):
  `env.sandbox.workers` on this machine (loopback), or one per `placement.sandbox` host (default: the
  inference hosts) on `cluster.sandbox_port`;
- what the classes the recipe names say (the backend's publish format, the environment's need of a
  sandbox) comes in as `Facts`, looked up by the launch layer (`prl.launch.configs`): this module
  imports none of them;
- ports: on one machine every port is chosen free and distinct within the resolve (`PortPicker`;
  a role that finds its port taken at bind time takes another, see `prl.transport.ports`); on a
  cluster they are configured (`cluster.*_port`, `inference.kv_pool.port`, default 50051).
"""

from __future__ import annotations

import json
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from prl.recipe.roles import (
    EngineWorkerConfig,
    KvMasterConfig,
    OrchestratorConfig,
    ProcessConfig,
    RewardModelConfig,
    SandboxConfig,
    ServerConfig,
    TrainerConfig,
    load_process_config,
)
from prl.recipe.schema import HostCfg, Recipe

__all__ = ["Facts", "ProcessConfig", "load_process_config", "resolve", "write_configs", "write_secret", "free_port"]

LOCAL = "local"
WORKSTATION = "workstation"
KV_MASTER_PORT = 50051


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PortPicker:
    """Free ports of one host, never the same one twice in one resolve (the OS may hand out a port
    it just handed out, once its probe socket is closed)."""

    def __init__(self, host: str):
        self.host, self.given = host, set()

    def __call__(self) -> int:
        while True:
            port = free_port(self.host)
            if port not in self.given:
                self.given.add(port)
                return port


def write_secret(run_dir: Path) -> Path:
    path = run_dir / "secret"
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(32))
    return path


@dataclass(frozen=True)
class Facts:
    """What resolution asks of the classes the recipe names (`prl.launch.configs.facts` looks them up)."""

    publish_format: str  # the backend's weight names, "memory" | "hf" (`BackendSpec.publish_format`)
    sandbox: bool  # the environment class declares `needs_sandbox`: the run has sandbox workers


@dataclass(frozen=True)
class Place:
    """Where a process runs: its host (node), the address it binds there, that host's run directory."""

    node: str
    address: str
    run_dir: str
    gpus: int = 0


def host_run_dir(recipe: Recipe, h: HostCfg) -> str:
    return f"{recipe.cluster.workdir_of(h)}/runs/{recipe.run.name}"


class Layout:
    """The hosts of a recipe (a cluster, or this machine as one host) and the ports to give out."""

    def __init__(self, recipe: Recipe, run_dir: Path):
        self.recipe = recipe
        if recipe.cluster is None:
            inf = recipe.inference
            self.here = Place(LOCAL, inf.host, str(run_dir))
            self.trainers = [self.here]
            self.server_places = [self.here] * inf.num_servers
            self.orchestrator = self.here
            self.pool_place = self.here
            self.sandbox_places = [Place(LOCAL, "127.0.0.1", str(run_dir))] * recipe.env.sandbox.workers
            self.pick = PortPicker(inf.host)
        else:
            self._cluster(recipe, run_dir)
        self.first = self.trainers[0]

    def _cluster(self, recipe: Recipe, run_dir: Path) -> None:
        hosts, p = recipe.cluster.hosts_by_id(), recipe.placement_or_default()
        place = {hid: Place(hid, h.address, host_run_dir(recipe, h), h.gpus) for hid, h in hosts.items()}
        self.trainers = [place[n] for n in p.trainer]
        self.server_places = [place[n] for n in p.inference for _ in range(p.servers_on(hosts[n]))]
        orch = p.orchestrator or p.trainer[0]
        self.orchestrator = Place(WORKSTATION, "127.0.0.1", str(run_dir)) if orch == WORKSTATION else place[orch]
        self.pool_place = place[recipe.inference.kv_pool.host or p.inference[0]]
        self.sandbox_places = [place[n] for n in p.sandbox or p.inference]
        self.pick = None

    def server_slots(self) -> list[int]:
        """Each server's slot on its own host (0, 1, ... per host, in placement order)."""
        seen: dict[str, int] = {}
        out = []
        for pl in self.server_places:
            out.append(seen.get(pl.node, 0))
            seen[pl.node] = out[-1] + 1
        return out

    def server_ports(self, slots: list[int]) -> list[int]:
        inf = self.recipe.inference
        if self.recipe.cluster is not None:  # ports count up per host
            return [self.recipe.cluster.inference_port + k for k in slots]
        return [inf.port + i if inf.port else self.pick() for i in range(inf.num_servers)]

    def trainer_port(self) -> int:
        return self.recipe.cluster.trainer_port if self.recipe.cluster is not None else self.pick()

    def sandbox_port(self) -> int:
        return self.recipe.cluster.sandbox_port if self.recipe.cluster is not None else self.pick()

    def pool_ports(self) -> tuple[int, int, int]:
        base = self.recipe.inference.kv_pool.port or (KV_MASTER_PORT if self.recipe.cluster is not None else 0)
        return (base, base + 1, base + 2) if base else (self.pick(), self.pick(), self.pick())


def resolve(recipe: Recipe, run_dir: Path, secret_file: Path | None = None, *, facts: Facts) -> list[ProcessConfig]:
    """One config per process: the KV pool's master (if any), the servers, the sandbox workers (if any), the
    orchestrator, the trainer (one per trainer host). `prl.launch.configs.resolve` passes the `facts`."""
    lay = Layout(recipe, Path(run_dir))
    env = recipe.cluster.env if recipe.cluster is not None else {}

    def common(pl: Place, picked: bool = True) -> dict:
        secret = str(secret_file) if secret_file is not None and pl.node == LOCAL else f"{pl.run_dir}/secret"
        return dict(run_dir=pl.run_dir, secret_file=secret, node=pl.node, run=recipe.run, process_env=env,
                    port_fallback=picked and pl.node == LOCAL)

    trainers = trainer_configs(recipe, lay, common, facts.publish_format)
    trainer_url = f"http://{trainers[0].host}:{trainers[0].port}"
    servers, workers = engines(recipe, server_configs(recipe, lay, common, trainer_url))
    if recipe.trainer.weight_transfer != "folder":  # rank 0 forms the weight group with every server
        for t in trainers:
            t.servers = [f"http://{s.host}:{s.port}" for s in servers]
    pool = kv_master_configs(recipe, lay, common, [*servers, *workers])  # every engine rank joins the pool
    sandboxes = sandbox_configs(recipe, lay, common) if facts.sandbox else []
    orch = orchestrator_config(recipe, lay, common, servers, trainer_url)
    orch.sandboxes = [f"http://{s.host}:{s.port}" for s in sandboxes]
    teachers = frozen_configs(recipe, lay, common, "teacher", recipe.teacher)
    orch.teachers = [f"http://{s.host}:{s.port}" for s in teachers]
    judge = recipe.reward.judge
    judges = frozen_configs(recipe, lay, common, "judge", judge if judge is not None and judge.path else None)
    orch.judges = [f"http://{s.host}:{s.port}" for s in judges]
    scorers = reward_model_configs(recipe, lay, common)
    orch.reward_models = [f"http://{s.host}:{s.port}" for s in scorers]
    return [*pool, *servers, *workers, *teachers, *judges, *scorers, *sandboxes, orch, *trainers]


def reward_model_configs(recipe: Recipe, lay: Layout, common) -> list[RewardModelConfig]:
    """`[reward.model]`: its servers, on the orchestrator's machine, serving the frozen folder."""
    rm = recipe.reward.model
    if rm is None:
        return []
    pl = lay.orchestrator
    return [RewardModelConfig(name=f"reward-model-{i}", host=pl.address, port=lay.pick(), index=i, reward_model=rm,
                              threads=rm.threads, **common(pl)) for i in range(rm.servers)]


def frozen_configs(recipe: Recipe, lay: Layout, common, kind: str, cfg) -> list[ServerConfig]:
    """A model the run serves beside the policy (`kind`: "teacher", "judge"; `cfg` its table with `path` and
    `servers`, None without one): its inference servers on the orchestrator's machine, serving the frozen folder
    (never sent a weight version)."""
    if cfg is None:
        return []
    pl = lay.orchestrator
    return [ServerConfig(name=f"{kind}-{i}", host=pl.address, port=lay.pick(), index=i,
                         inference=recipe.inference, pretrained=True, model_folder=cfg.path,
                         threads=recipe.inference.threads, **common(pl))
            for i in range(cfg.servers)]


def trainer_configs(recipe: Recipe, lay: Layout, common, publish_format: str) -> list[TrainerConfig]:
    port, world = lay.trainer_port(), recipe.trainer_world()
    rendezvous = f"{lay.first.address}:{recipe.cluster.rendezvous_port}" if recipe.cluster is not None else ""
    return [TrainerConfig(
        name="trainer" if len(lay.trainers) == 1 else f"trainer-{i}", host=pl.address, port=port, index=i,
        model=recipe.model, task=recipe.task, env=recipe.env, sft=recipe.sft, rl=recipe.rl, sampling=recipe.sampling,
        trainer=recipe.trainer, publish_format=publish_format, publish_fp8=recipe.inference.fp8,
        shared_checkpoints=recipe.shared_checkpoints(), world=world, nnodes=len(lay.trainers),
        rendezvous=rendezvous, threads=recipe.trainer.threads, eval_points=recipe.eval_points(),
        await_orchestrator=bool(recipe.eval), teacher_kl_coef=teacher_kl_coef(recipe),
        teacher_kl_estimator=recipe.teacher.kl_estimator if recipe.teacher is not None else "k2", **common(pl),
    ) for i, pl in enumerate(lay.trainers)]


def teacher_kl_coef(recipe: Recipe) -> float:
    """The KL to the teacher's weight in the trainer's loss (teacher.mode = "loss"), else 0."""
    t = recipe.teacher
    return t.kl_coef if t is not None and t.mode == "loss" else 0.0


def server_configs(recipe: Recipe, lay: Layout, common, trainer_url: str) -> list[ServerConfig]:
    inf, out = recipe.inference, []
    per = recipe.placement_or_default().gpus_per_server if recipe.cluster is not None else 1
    slots = lay.server_slots()
    for i, (pl, k, port) in enumerate(zip(lay.server_places, slots, lay.server_ports(slots))):
        out.append(ServerConfig(
            name=f"inference-{i}", host=pl.address, port=port, index=i, inference=inf,
            router_replay=recipe.trainer.router_replay, pretrained=bool(recipe.model.path),
            keep_weights=recipe.trainer.keep_weights, trainer_url=trainer_url,
            weight_transfer=recipe.cluster.weight_transfer if recipe.cluster is not None else "http",
            shares_trainer_fs=pl.node == lay.first.node, threads=inf.threads,
            gpus=list(range(k * per, (k + 1) * per)) if pl.gpus else [], **common(pl, picked=not inf.port),
        ))
    return out


def engines(recipe: Recipe, hosts: list[ServerConfig]) -> tuple[list[ServerConfig], list[EngineWorkerConfig]]:
    """`inference.hosts_per_engine = h > 1`: each h consecutive inference hosts are one engine; the
    first host's server is its leader (the API server the run talks to, named inference-E), the
    others run its headless data-parallel ranks. With h = 1 every host's server stands alone."""
    h = recipe.inference.hosts_per_engine
    if h == 1:
        return hosts, []
    leaders, workers, local = [], [], recipe.inference.local_replicas()
    for e, group in enumerate(hosts[i:i + h] for i in range(0, len(hosts), h)):
        leader = group[0].model_copy(update={"name": f"inference-{e}", "index": e,
                                             "engine_rpc": f"{group[0].host}:{recipe.cluster.engine_rpc_port}"})
        leaders.append(leader)
        workers += [EngineWorkerConfig(**{**s.model_dump(exclude={"role", "name", "index"}),
                                          "engine_rpc": leader.engine_rpc}, name=f"{leader.name}-host{k}", index=e,
                                       engine=leader.name, start_rank=k * local) for k, s in enumerate(group) if k]
    return leaders, workers


def orchestrator_config(recipe: Recipe, lay: Layout, common, servers: list[ServerConfig],
                        trainer_url: str) -> OrchestratorConfig:
    par = recipe.trainer.parallel
    return OrchestratorConfig(
        name="orchestrator", rl=recipe.rl, sampling=recipe.sampling, task=recipe.task, env=recipe.env,
        eval=recipe.eval, training_reach=recipe.training_reach(), backend=recipe.inference.backend,
        warm_start_examples=recipe.sft.steps_for(recipe.model) * recipe.sft.batch_size,
        sft=recipe.sft if recipe.sft.data is not None else None,
        startup_timeout_s=recipe.inference.startup_timeout_s,
        router_replay=recipe.trainer.router_replay, servers=[f"http://{s.host}:{s.port}" for s in servers],
        prefill_servers=list(range(recipe.inference.prefill_servers)), trainer_url=trainer_url,
        data_parallel=par.dims(recipe.trainer_world()).dp_size,
        micro_batch_tokens=recipe.trainer.micro_batch_tokens, share_prompts=recipe.trainer.shares_prompts,
        draft_weights=bool(recipe.inference.mtp_tokens and recipe.inference.fp8), teacher=recipe.teacher,
        reward=recipe.reward,
        **common(lay.orchestrator),
    )


def kv_master_configs(recipe: Recipe, lay: Layout, common, servers: list[ServerConfig]) -> list[KvMasterConfig]:
    """With `inference.kv_pool`, the `kv-master` process, its address told to every server."""
    if not recipe.inference.kv_pool.enabled:
        return []
    pl, ports = lay.pool_place, lay.pool_ports()
    addr = {"host": pl.address, "rpc_port": ports[0], "metadata_port": ports[1], "metrics_port": ports[2]}
    for s in servers:
        s.kv_master = addr
    return [KvMasterConfig(name="kv-master", host=pl.address, port=ports[0], kv_pool=recipe.inference.kv_pool,
                           kv_master=addr, **common(pl, picked=not recipe.inference.kv_pool.port))]


def sandbox_configs(recipe: Recipe, lay: Layout, common) -> list[SandboxConfig]:
    """The workers model-written code runs in (for an environment that needs the sandbox, `env.kind = "code"`)."""
    return [SandboxConfig(name=f"sandbox-{i}", host=pl.address, port=lay.sandbox_port(), index=i,
                          sandbox=recipe.env.sandbox, **common(pl))
            for i, pl in enumerate(lay.sandbox_places)]


def write_configs(configs: list[ProcessConfig], run_dir: Path) -> dict[str, Path]:
    out = run_dir / "config"
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for c in configs:
        paths[c.name] = out / f"{c.name}.json"
        paths[c.name].write_text(json.dumps(c.model_dump(), indent=1))
    return paths

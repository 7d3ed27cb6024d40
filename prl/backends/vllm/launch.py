"""Start a vLLM OpenAI server for one inference slot of a run.

`vllm_args(cfg)` is the full vLLM command line (shown by `--dry-run`); the process prl starts is
`python -m prl.backends.vllm.launch --config CFG -- python -m vllm.entrypoints.openai.api_server ARGS`,
which writes the model folder's FP8 serving layout (`inference.fp8`: the block-FP8 `quantization_config`
vLLM builds its layers from), puts the run's secret into `VLLM_API_KEY` (never on a command line), turns on the RL routes
(`VLLM_SERVER_DEV_MODE=1`), tells the weight-transfer plugin its config (`PRL_CONFIG`), and
replaces itself with vLLM (`exec`: same pid, same process group, so prl's teardown reaches every
vLLM child).

prl sets the arguments that the rest of the run depends on; `[inference.vllm]` passes any other
vLLM argument through (`max_num_seqs = 32` -> `--max-num-seqs 32`, `true` -> a bare flag, `false`
-> `--no-...`); setting one of prl's own is refused when the recipe is validated.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from prl.recipe.roles import ServerConfig

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
HEADLESS = "prl.backends.vllm.headless"  # vLLM's `serve --headless`: a multi-host engine's ranks without an API server
AUTH_MIDDLEWARE = "prl.backends.vllm.auth.require_bearer"
# set in [inference.vllm], any of these leaves the server's parallel layout to the user
PARALLEL_ARGS = frozenset({"tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"})


def weight_engine(cfg: ServerConfig) -> str:
    """prl's own engine in every worker: the folder from the trainer endpoint, and the collective
    stream (`prl.backends.vllm.collective`: gloo, or NCCL where every member holds a GPU)."""
    return json.dumps({"backend": "prl"}, separators=(",", ":"))


def option_flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def passthrough(options: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in options.items():
        if value is True:
            out.append(option_flag(key))
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            out += [option_flag(key), json.dumps(value, separators=(",", ":"))]
        elif isinstance(value, list):
            out += [option_flag(key), *map(str, value)]
        else:
            out += [option_flag(key), str(value)]
    return out


def vllm_args(cfg: ServerConfig) -> list[str]:
    """Everything after `python -m vllm.entrypoints.openai.api_server`."""

    inf = cfg.inference
    args = [
        "--model", str(cfg.model_dir), "--served-model-name", cfg.run.name,
        "--host", cfg.host, "--port", str(cfg.port),
        "--dtype", inf.dtype, "--seed", str(cfg.run.seed + 1000 * cfg.index),
        "--max-num-seqs", str(inf.max_batch_size),
        "--enable-scale-out",  # /inference/v1/generate: token ids in and out
        "--logprobs-mode", "processed_logprobs",  # log_softmax(logits / T): what the trainer recomputes
        "--generation-config", "vllm",  # the folder's sampling defaults (penalties) would change logprobs
        "--weight-transfer-config", weight_engine(cfg),
        "--middleware", AUTH_MIDDLEWARE,
    ]
    if inf.fp8:  # block-FP8 layers as the model folder's quantization_config names them (`main` writes it)
        args += ["--quantization", "fp8"]
    if not cfg.pretrained or inf.fp8:  # version 0 arrives before any rollout (FP8: the trainer's own values;
        args += ["--load-format", "dummy"]  # a bf16 folder would not load into FP8 layers)
    if cfg.router_replay:
        args.append("--enable-return-routed-experts")
    if cfg.kv_master:  # the run's KV pool: prompt blocks through Mooncake, keyed by the run and (cache_salt) version
        args += ["--kv-transfer-config", json.dumps(kv_transfer(cfg.run.name), separators=(",", ":"))]
    return args + layout_args(cfg) + passthrough(inf.vllm)


def layout_args(cfg: ServerConfig) -> list[str]:
    """The serving layout: `inference.data_parallel_size` attention replicas (each its own sequences and
    KV), the experts split over them with `inference.expert_parallel`, each replica tensor parallel over
    its share of the server's GPUs. Over several hosts (`engine_rpc` set) each host runs
    `data_parallel_local` of the ranks: the leader's first, a worker's from its `start_rank`, headless.
    What `[inference.vllm]` sets itself is left to it."""
    inf, given = cfg.inference, {k.replace("-", "_") for k in cfg.inference.vllm}
    args = []
    if inf.data_parallel_size > 1 and "data_parallel_size" not in given:
        args += ["--data-parallel-size", str(inf.data_parallel_size)]
    if cfg.engine_rpc:  # one engine over several hosts, as vLLM's multi-node data parallel: ranks per host,
        address, port = cfg.engine_rpc_address()  # the leader's address and RPC port for all
        args += ["--data-parallel-size-local", str(inf.local_replicas()), "--data-parallel-address", address,
                 "--data-parallel-rpc-port", str(port)]
        if cfg.role == "engine_worker":
            args += ["--headless", "--data-parallel-start-rank", str(cfg.start_rank)]
    if inf.expert_parallel and "enable_expert_parallel" not in given:
        args.append("--enable-expert-parallel")
    if inf.redundant_experts and inf.expert_parallel and "enable_eplb" not in given:  # extra slots so the GPUs divide the experts
        args += ["--enable-eplb", "--eplb-config",
                 json.dumps({"num_redundant_experts": inf.redundant_experts}, separators=(",", ":"))]
    if inf.kv_cache_dtype != "auto" and "kv_cache_dtype" not in given:  # fp8: MLA latent + DSA indexer keys in FP8
        args += ["--kv-cache-dtype", inf.kv_cache_dtype]
    if inf.mtp_tokens and "speculative_config" not in given:  # the checkpoint's MTP layer drafts (prl.model.mtp)
        args += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": inf.mtp_tokens},
                                                    separators=(",", ":"))]
    tp = replica_tp(cfg)
    if tp > 1 and not given & PARALLEL_ARGS:
        args += ["--tensor-parallel-size", str(tp)]  # a replica spans its share of placement.gpus_per_server
    return args


def replica_tp(cfg: ServerConfig) -> int:
    """GPUs of one attention replica: the server's GPUs over its replicas on this host (1 on CPU)."""
    return len(cfg.gpus) // cfg.inference.local_replicas() if cfg.gpus else 1


def cpu_binding(cfg: ServerConfig, env: dict) -> dict[str, str]:
    """On CPU with data parallel replicas, each replica's engine gets its own cores
    (`VLLM_CPU_OMP_THREADS_BIND`, e.g. "0|1"), unless the run's environment sets it."""
    dp = cfg.inference.local_replicas()  # this host's engines (an engine over several hosts runs some on each)
    if cfg.gpus or dp <= 1 or "VLLM_CPU_OMP_THREADS_BIND" in env:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // dp)
    groups = [cores[i * per:(i + 1) * per] or cores[-1:] for i in range(dp)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)}


def kv_transfer(run_name: str) -> dict:
    """vLLM's MooncakeStoreConnector: keys start with the run's name; each request's `cache_salt`
    (prl-vN) is hashed into its first block, so KV from another weights version never matches; a
    block that cannot be loaded is recomputed, not a failed request."""
    return {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cache_prefix": run_name}}


def launch_command(cfg: ServerConfig, python: str) -> list[str]:
    """The leader (or a lone server): vLLM's API server; an engine worker: vLLM's `serve --headless`."""
    return [python, "-m", "prl.backends.vllm.launch", "--config", cfg.config_path, "--",
            python, "-m", HEADLESS if cfg.role == "engine_worker" else VLLM_MODULE, *vllm_args(cfg)]


def main(argv: list[str]) -> None:
    from prl.recipe.resolve import load_process_config

    if len(argv) < 4 or argv[0] != "--config" or argv[2] != "--":
        raise SystemExit("usage: python -m prl.backends.vllm.launch --config CFG -- VLLM_COMMAND...")
    cfg = load_process_config(argv[1])
    serving_layout(cfg)
    env = {**os.environ, "VLLM_API_KEY": cfg.secret(), "VLLM_SERVER_DEV_MODE": "1", "PRL_CONFIG": argv[1]}
    env.update(cpu_binding(cfg, env))
    if cfg.kv_master:
        env.update(join_pool(cfg))
    command = settle_port(cfg, argv[3:])
    print(f"{cfg.name}: exec {' '.join(command)}", flush=True)
    os.execvpe(command[0], command, env)


def serving_layout(cfg: ServerConfig) -> None:
    """The model folder's `quantization_config` as this server serves it: prl's block-FP8 layout
    (`prl.model.fp8_checkpoint.serving_config`) with inference.fp8, none without. vLLM builds its FP8
    layers from it, and prl's weight engine checks published versions against it."""
    if cfg.model_folder:
        return  # a frozen model the run serves (a teacher's): the user's own folder, served as it is, never written
    if not cfg.inference.fp8 and "quantization_config" not in json.loads((cfg.model_dir / "config.json").read_text()):
        return  # nothing to write, and no torch to import
    from prl.model.fp8_checkpoint import write_serving_config

    qc = write_serving_config(cfg.model_dir, cfg.inference.fp8)
    if qc:
        print(f"{cfg.name}: block-FP8 weights, {len(qc['modules_to_not_convert'])} modules kept in "
              f"{cfg.inference.dtype}", flush=True)


def settle_port(cfg: ServerConfig, command: list[str]) -> list[str]:
    """On one machine, the port vLLM will bind: the given one if free now, else one the OS picks
    (`--port` rewritten), published for the orchestrator. vLLM binds it itself, so a race lost after
    this probe fails the start, and the restart probes again (never the same taken port)."""
    from prl.transport import ports

    if not cfg.port_fallback:
        return command
    found = ports.lookup(cfg.run_dir, cfg.name)  # a restart first tries the port it had
    port = ports.pick(cfg.host, [found[1][0] if found else cfg.port])[0]
    i = command.index("--port")
    ports.publish(cfg.run_dir, cfg.name, cfg.host, port)
    return [*command[:i + 1], str(port), *command[i + 2:]]


def join_pool(cfg: ServerConfig) -> dict[str, str]:
    """Wait for the run's KV-pool master, write the store config vLLM's connector reads, and return
    the environment that points it there."""
    from pathlib import Path

    from prl.inference.kv_master import vllm_store_config, wait_for_master

    addr = wait_for_master(cfg, cfg.inference.startup_timeout_s)
    path = Path(cfg.run_dir) / "config" / f"{cfg.name}-mooncake.json"
    path.write_text(json.dumps(vllm_store_config(addr, cfg.host, cfg.inference.kv_pool.memory_gb)))
    print(f"{cfg.name}: KV pool at {addr.master} ({path})", flush=True)
    # vLLM's connector ignores the config's local_hostname and advertises the address of the default
    # route unless told; peers read this server's segment there, so it must be the placed address.
    return {"MOONCAKE_CONFIG_PATH": str(path), "MC_STORE_CLIENT_SETUP_RETRIES": "1",
            "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": cfg.host}


if __name__ == "__main__":
    main(sys.argv[1:])

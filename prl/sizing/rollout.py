"""A layout's rollout per trainer step: decode, prefill, the weight update, and the latency of a
trajectory (which, by Little's law, sets the sequences in flight and the staleness async needs).

Each replica keeps as many sequences in flight as its KV holds, at most inference.max_batch_size and
its share of what the staleness bound and rl.max_inflight_rollouts allow (`workload.async_cap`).
Sequences waiting on a tool or the sandbox keep their KV but do not decode.
"""

from __future__ import annotations

from dataclasses import dataclass

from prl.recipe.schema import Recipe
from prl.sizing import kv, lora
from prl.sizing.decode import Step, decode_step
from prl.sizing.layouts import Layout, experts_per_gpu, kv_capacity, serving_weights
from prl.sizing.params import Counts
from prl.sizing.workload import Workload, async_cap


@dataclass
class Rollout:
    layout: Layout
    memory: dict[str, float]  # one GPU's bytes
    fits: float  # sequences one replica's KV holds
    held: float  # sequences one replica keeps in flight
    step: Step  # one decode step at the decoding share of `held`
    rate: float  # tokens a second of one sequence
    times: dict[str, float]  # seconds per trainer step: decode, prefill, weight update
    latency: float  # seconds of a mean trajectory
    latency_p99: float

    @property
    def seconds(self) -> float:
        return sum(self.times.values())

    @property
    def tokens_per_gpu(self) -> float:
        return self.step.tokens / self.step.seconds * self.layout.dp / self.layout.gpus


def prefill_flops(c: dict, n: Counts, context: float) -> tuple[float, float, float]:
    """(GEMM, attention, indexer) FLOPs of prefilling one token at `context` earlier tokens: every
    active parameter once, attention over min(index_topk, context) keys (not absorbed: q.k over
    nope + rope and values, per head), the indexer over every key."""
    gemm = 2 * n.active
    if not kv.is_dsa(c):
        hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return gemm, 4 * c["num_attention_heads"] * hd * context * c["num_hidden_layers"], 0.0
    per_key = 2 * c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"])
    attn = per_key * min(c["index_topk"], context) * c["num_hidden_layers"]
    return gemm, attn, 2 * c["index_n_heads"] * c["index_head_dim"] * context * kv.indexer_layers(c)


def prefill_seconds(recipe: Recipe, c: dict, n: Counts, w: Workload, gpus: int) -> float:
    """Prefill of one step on `gpus` GPUs: each group's prompt once (its members share it through the
    prefix cache), and every trajectory's environment tokens (earlier turns' KV is reused)."""
    pl = recipe.plan
    gemm_peak = (pl.fp8_tflops if recipe.inference.fp8 else pl.gpu_tflops) * 1e12 * pl.mfu
    total = 0.0
    for tokens, context in ((w.batch / w.group * w.prompt, w.prompt / 2), (w.batch * w.env, w.inflight_context)):
        g, a, i = prefill_flops(c, n, context)
        total += tokens * (g / gemm_peak + a / (pl.gpu_tflops * 1e12 * pl.mfu) + i / (pl.fp8_tflops * 1e12 * pl.mfu))
    return total / gpus


def kv_transfer_seconds(recipe: Recipe, c: dict, w: Workload, layout: Layout) -> float:
    """P/D: the KV of every prefilled token, from the prefill pool's GPUs over the network."""
    tokens = w.batch / w.group * w.prompt + w.batch * w.env
    fp8 = recipe.inference.kv_cache_dtype == "fp8"
    gpus = layout.prefill_hosts * layout.per_host
    return tokens * kv.kv_bytes_per_token(c, fp8) / (gpus * recipe.plan.network_gb_s * 1e9)


def host_bytes(recipe: Recipe, c: dict, n: Counts, layout: Layout) -> tuple[float, float]:
    """(bytes one host of an engine needs, of them replicated on every GPU of the host) for a new
    version: under DP attention the non-expert weights are the same on every GPU of a host. Under LoRA
    a version is the adapters alone (`prl.sizing.lora`), wanted by every GPU of the host but the routed
    experts' (each GPU its own experts')."""
    if recipe.trainer.lora.enabled:
        adapters, shared = lora.host_update_bytes(recipe, c, n, experts_per_gpu(c, layout) * layout.per_host)
        return adapters, shared if layout.per_host > 1 else 0.0
    per_gpu = serving_weights(recipe, c, n, layout)
    whole = sum(per_gpu.values())
    shared = sum(v for k, v in per_gpu.items() if not k.startswith("routed")) if layout.dp > 1 else 0.0
    return shared + (whole - shared) * layout.per_host, shared


def pools(layout: Layout) -> list[tuple[Layout, int]]:
    """(engine shape, hosts) of the decode pool, and of the prefill pool under P/D."""
    out = [(layout, layout.engines * layout.hosts)]
    return out + [(layout.prefill_engine(), layout.prefill_hosts)] if layout.prefill_hosts else out


def weights_moved(recipe: Recipe, c: dict, n: Counts, layout: Layout) -> float:
    """Bytes a weight update delivers to all the inference hosts."""
    return sum(hosts * host_bytes(recipe, c, n, lay)[0] for lay, hosts in pools(layout))


def collective(recipe: Recipe) -> bool:
    """Weights streamed from every trainer rank (cluster.weight_transfer = "nccl" sets it)."""
    return recipe.trainer.weight_transfer == "stream"


def weight_send_seconds(recipe: Recipe, c: dict, n: Counts, layout: Layout, trainer_gpus: int) -> float:
    """The trainer's side of a weight update: everything over all trainer GPUs' links (collective),
    or over trainer rank 0's link (files over HTTP)."""
    net = recipe.plan.network_gb_s * 1e9
    return weights_moved(recipe, c, n, layout) / (trainer_gpus * net if collective(recipe) else net)


def weight_update_seconds(recipe: Recipe, c: dict, n: Counts, layout: Layout, trainer_gpus: int) -> float:
    """Moving a step's new weights into the servers (paused meanwhile): every host receives its own
    bytes once over all its GPUs' links, replicated tensors then spread over NVLink, and no faster
    than the trainer sends; under LoRA each GPU then merges the adapters into its weights."""
    pl = recipe.plan
    receive = 0.0
    for lay, _ in pools(layout):
        host, shared = host_bytes(recipe, c, n, lay)
        merge = lora.merge_seconds(recipe, c, n, lay.tp, experts_per_gpu(c, lay)) if recipe.trainer.lora.enabled else 0
        receive = max(receive, host / (lay.per_host * pl.network_gb_s * 1e9) + shared / (pl.nvlink_gb_s * 1e9) + merge)
    return max(receive, weight_send_seconds(recipe, c, n, layout, trainer_gpus))


def settle(recipe: Recipe, c: dict, n: Counts, layout: Layout, w: Workload, held: float) -> tuple[Step, float]:
    """The decode step and per-sequence rate when `held` sequences are in flight on a replica, of which
    the share not waiting on the environment decodes (a few fixed-point rounds)."""
    busy = held
    for _ in range(8):
        step = decode_step(recipe, c, n, layout, busy, w.inflight_context, w.context_cv)
        rate = step.tokens / busy / step.seconds
        decoding = w.model / rate
        busy = held * decoding / (decoding + w.env_seconds) if decoding + w.env_seconds else held
    return step, rate


def evaluate(recipe: Recipe, c: dict, n: Counts, layout: Layout, w: Workload, trainer_gpus: int,
             capped: bool = True) -> Rollout:
    """The layout's rollout per step. `capped`: as the recipe runs it (at most inference.max_batch_size
    sequences a replica, and what rl.max_async_level and rl.max_inflight_rollouts allow); else at what
    its KV holds (how the planner compares layouts)."""
    memory, fits = kv_capacity(recipe, c, n, layout, w.inflight_context, w.p99)
    caps = (recipe.inference.max_batch_size, async_cap(recipe) / layout.replicas) if capped else ()
    held = max(min((fits, *caps)), 1e-9)
    step, rate = settle(recipe, c, n, layout, w, held)
    throughput = layout.replicas * step.tokens / step.seconds
    times = {"decode": w.batch * w.model / throughput}
    prefill = prefill_seconds(recipe, c, n, w, layout.prefill_hosts * layout.per_host or layout.engines * layout.gpus)
    if layout.prefill_hosts:  # in parallel with decode on its own GPUs, the KV then crossing the network
        times["prefill pool beyond decode"] = max(0.0, prefill + kv_transfer_seconds(recipe, c, w, layout) - times["decode"])
    else:
        times["prefill"] = prefill
    times["weight update"] = weight_update_seconds(recipe, c, n, layout, trainer_gpus)
    latency = w.model / rate + w.env_seconds
    return Rollout(layout, memory, fits, held, step, rate, times, latency, w.p99_model / rate + w.env_seconds)

"""One decode step of one GPU: the bytes it reads, the FLOPs it computes, what it exchanges.

A step advances each of the replica's `batch` sequences by one token, or, with MTP, verifies
`mtp_tokens` draft tokens too (1 + d query tokens a sequence) and keeps 1 + a + a^2 + ... + a^d of
them on average (a = the acceptance rate, an assumption). The step takes the longer of its memory
time (bytes / (HBM bandwidth x plan.decode_efficiency)) and its compute time (FLOPs at plan.mfu of
the peak of each GEMM's dtype), plus its communication, which is not overlapped (vLLM's dual-batch
overlap would hide part of it; not counted).

Bytes read per GPU and step: the non-expert weights (whole under DP attention, 1/TP under TP), the
routed experts the step's tokens touch among this GPU's, the MTP layer and head once per draft
token, and the KV: DSA attention reads `index_topk` latent entries per query token and layer
(sparse), and the indexer reads every key of the sequence once; a dense-attention model reads all
its KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prl.model.families import routed_experts
from prl.recipe.schema import Recipe
from prl.sizing import kv
from prl.sizing.layouts import Layout, experts_per_gpu, mtp_layer, weight_bytes
from prl.sizing.params import Counts


@dataclass(frozen=True)
class Step:
    memory: dict[str, float]  # bytes read per GPU
    flops: dict[str, float]  # seconds of compute per GPU, by part
    comm: float  # seconds
    seconds: float  # the step
    tokens: float  # tokens the replica keeps per step


def accepted(d: int, a: float) -> float:
    """Tokens a sequence keeps per step with d draft tokens accepted each with probability a (in a chain)."""
    return 1 + sum(a ** i for i in range(1, d + 1))


def touched(experts: int, k: int, tokens: float) -> float:
    """Expected fraction of a layer's experts at least one of `tokens` tokens (k experts each) routes to."""
    return 1 - (1 - k / experts) ** tokens if experts else 0.0


def weight_reads(recipe: Recipe, c: dict, n: Counts, layout: Layout, queries: float) -> dict[str, float]:
    """Weight bytes one GPU reads in one step; `queries` = query tokens per replica."""
    wb, tp, d = weight_bytes(recipe), layout.tp, recipe.inference.mtp_tokens
    moe_layers = sum(1 for e in n.experts if e)
    E, k = routed_experts(c) or 0, c["num_experts_per_tok"]
    frac = touched(E, k, queries * layout.dp)  # the engine's tokens reach this GPU's experts
    experts = experts_per_gpu(c, layout) * frac * n.expert_size * wb
    out = {"non-expert weights": (n.dense - n.embed - n.head + n.buffers) * wb / tp + n.head * 2 / tp,
           f"routed experts touched ({frac:.0%} of this GPU's)": experts * moe_layers}
    if d:
        dense, _ = mtp_layer(c, n)
        out["MTP layer and head, per draft token"] = d * (dense * wb / tp + experts + n.head * 2 / tp)
    return out


def kv_reads(recipe: Recipe, c: dict, layout: Layout, batch: float, context: float) -> dict[str, float]:
    """KV bytes one GPU reads in one step for the replica's `batch` sequences of `context` tokens."""
    fp8, q = recipe.inference.kv_cache_dtype == "fp8", 1 + recipe.inference.mtp_tokens
    share = kv.kv_share(c, layout.tp)
    if not kv.is_dsa(c):
        return {"KV (every key)": batch * context * kv.latent_bytes(c, fp8) * c["num_hidden_layers"] * share}
    sparse = min(c["index_topk"], context) * q * kv.latent_bytes(c, fp8) * c["num_hidden_layers"]
    index = context * kv.indexer_bytes(c, fp8) * kv.indexer_layers(c)
    return {f"latent KV, sparse ({c['index_topk']} keys a query token)": batch * sparse * share,
            "indexer keys (every key, once a step)": batch * index * share}


def compute_times(recipe: Recipe, c: dict, n: Counts, layout: Layout, queries: float, context: float) -> dict[str, float]:
    """Seconds of compute per GPU: the GEMMs (FP8 peak when serving FP8), MLA attention over the
    selected keys (absorbed: (latent + rope) scores and latent values per head, bf16), the indexer
    over every key (FP8, as DSA's)."""
    pl = recipe.plan
    fp8_peak, bf16_peak = pl.fp8_tflops * 1e12 * pl.mfu, pl.gpu_tflops * 1e12 * pl.mfu
    gemm_peak = fp8_peak if recipe.inference.fp8 else bf16_peak
    moe_layers = sum(1 for e in n.experts if e)
    k, layers = c["num_experts_per_tok"], c["num_hidden_layers"]
    dense = queries * 2 * (n.dense - n.embed) / layout.tp
    experts = queries * layout.dp * k * 2 * n.expert_size * moe_layers / layout.gpus * pl.expert_imbalance
    out = {"GEMMs": (dense + experts) / gemm_peak}
    if kv.is_dsa(c):
        heads = c["num_attention_heads"] / layout.tp
        per_key = heads * 2 * (2 * c["kv_lora_rank"] + c["qk_rope_head_dim"])
        out["MLA attention"] = queries * per_key * min(c["index_topk"], context) * layers / bf16_peak
        out["indexer"] = queries * 2 * c["index_n_heads"] / layout.tp * c["index_head_dim"] * context \
            * kv.indexer_layers(c) / fp8_peak
    return out


def exchange_seconds(recipe: Recipe, c: dict, n: Counts, layout: Layout, queries: float) -> float:
    """Communication of one step per GPU. DP + EP: each query token goes to k experts (FP8 dispatch,
    bf16 combine), a share (hosts - 1) / hosts of them on other hosts (network), the rest over NVLink,
    the busiest GPU receiving plan.expert_imbalance times the mean; two exchanges a MoE layer, each
    with a fixed latency. TP: two all-reduces of the hidden states a layer."""
    pl, h = recipe.plan, c["hidden_size"]
    layers = sum(1 for e in n.experts if e) + recipe.inference.mtp_tokens
    lat = pl.collective_latency_us * 1e-6
    if layout.dp > 1 and layout.ep_size > 1:
        rows = queries * c["num_experts_per_tok"] * pl.expert_imbalance * h * (1 + 4 / kv.FP8_BLOCK + 2)
        off = (layout.hosts - 1) / layout.hosts
        return layers * (rows * off / (pl.network_gb_s * 1e9) + rows * (1 - off) / (pl.nvlink_gb_s * 1e9) + 2 * lat)
    if layout.tp > 1:
        ring = 2 * (layout.tp - 1) / layout.tp * queries * h * 2
        return 2 * c["num_hidden_layers"] * (ring / (pl.nvlink_gb_s * 1e9) + lat)
    return 0.0


def lockstep(cv: float, batch: float, replicas: int) -> float:
    """The busiest replica's KV over the mean when `replicas` attention replicas step together (DP
    attention with EP: every step's all-to-all waits for all of them), each summing `batch`
    sequences whose KV lengths vary with coefficient `cv`: the expected maximum of `replicas` normal
    sums, mean + sd x sqrt(2 ln replicas)."""
    if replicas <= 1 or batch <= 0:
        return 1.0
    return 1 + cv / math.sqrt(batch) * math.sqrt(2 * math.log(replicas))


def decode_step(recipe: Recipe, c: dict, n: Counts, layout: Layout, batch: float, context: float,
                cv: float = 0.0) -> Step:
    """One step of one replica holding `batch` sequences of mean `context` tokens (KV lengths varying
    with coefficient `cv`: under DP attention + EP the busiest replica's KV sets the step)."""
    inf, pl = recipe.inference, recipe.plan
    queries = batch * (1 + inf.mtp_tokens)
    busiest = lockstep(cv, batch, layout.dp if layout.ep_size > 1 else 1)
    memory = {**weight_reads(recipe, c, n, layout, queries), **kv_reads(recipe, c, layout, batch, context * busiest)}
    flops = compute_times(recipe, c, n, layout, queries, context * busiest)
    comm = exchange_seconds(recipe, c, n, layout, queries)
    mem_s = sum(memory.values()) / (pl.hbm_tb_s * 1e12 * pl.decode_efficiency)
    seconds = max(mem_s, sum(flops.values())) + comm
    return Step(memory, flops, comm, seconds, batch * accepted(inf.mtp_tokens, pl.mtp_acceptance))

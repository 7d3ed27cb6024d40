"""Serving layouts for the inference hosts, and the memory of one GPU under each.

- **TP** (one engine per host, tensor parallel over its GPUs): weights split 8 ways, but MLA's latent
  KV is replicated on every GPU of the engine (`prl.sizing.kv`).
- **DP attention + EP** (each GPU its own attention replica with its own sequences and KV, the routed
  experts sharded over every GPU of the engine): within a host, or **wide EP** over several hosts,
  which divides the experts further and leaves more of each GPU to KV. The non-expert weights
  (attention, shared experts, dense layers, embeddings, head) are whole on every GPU.
- **P/D**: the same engines split into a prefill pool and a decode pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prl.model.families import routed_experts
from prl.recipe.schema import Recipe
from prl.sizing import kv
from prl.sizing.params import Counts

GB = 1e9


@dataclass(frozen=True)
class Layout:
    name: str
    engines: int  # decode engines (prefill engines apart)
    hosts: int  # hosts per engine
    gpus: int  # GPUs per engine
    dp: int  # attention replicas per engine
    ep: bool  # routed experts sharded over all the engine's GPUs
    prefill_hosts: int = 0  # P/D: hosts that only prefill, each one DP + EP engine

    @property
    def per_host(self) -> int:
        return self.gpus // self.hosts

    @property
    def tp(self) -> int:
        return self.gpus // self.dp

    @property
    def ep_size(self) -> int:
        """GPUs the routed experts are split over (under TP: the TP group, by experts or by rows)."""
        return self.gpus if self.ep else self.tp

    @property
    def replicas(self) -> int:
        return self.engines * self.dp

    def mechanisms(self, c: dict) -> tuple[str, ...]:
        out = ["tp"] if self.dp == 1 else ["dp_ep"] + (["wide_ep"] if self.hosts > 1 else [])
        if self.dp > 1 and (routed_experts(c) or 0) % self.ep_size:
            out.append("eplb")
        return tuple(out + (["pd"] if self.prefill_hosts else []))

    def prefill_engine(self) -> "Layout":
        """One host of the prefill pool: data-parallel attention + EP over its GPUs."""
        return Layout("prefill", self.prefill_hosts, 1, self.per_host, self.per_host, True)


def recipe_layout(recipe: Recipe) -> Layout:
    """The layout the recipe launches."""
    inf = recipe.inference
    if recipe.cluster is None:
        return Layout("the recipe's servers", inf.num_servers - inf.prefill_servers, 1, 1, 1, inf.expert_parallel,
                      inf.prefill_servers)
    p, hosts = recipe.placement_or_default(), recipe.cluster.hosts_by_id()
    per_host = p.servers_on(hosts[p.inference[0]])
    gpus = p.gpus_per_server * inf.hosts_per_engine
    engines = len(p.inference) * per_host // inf.hosts_per_engine
    prefill = inf.prefill_servers * inf.hosts_per_engine // per_host  # the first servers, whole hosts
    return Layout(describe(gpus, inf.data_parallel_size, inf.hosts_per_engine), engines - inf.prefill_servers,
                  inf.hosts_per_engine, gpus, inf.data_parallel_size, inf.expert_parallel or inf.data_parallel_size > 1,
                  prefill)


def describe(gpus: int, dp: int, hosts: int) -> str:
    if dp == 1:
        return f"TP{gpus} per {'host' if hosts == 1 else f'{hosts} hosts'}"
    tp = f" x TP{gpus // dp}" if gpus > dp else ""
    return f"DP{dp}{tp} + EP{gpus} " + ("per host" if hosts == 1 else f"over {hosts} hosts")


def candidates(recipe: Recipe, count: int = 0) -> list[Layout]:
    """TP per host, DP attention + EP within a host, and wide EP over every divisor of the inference
    hosts (`count`, or the recipe's; P/D variants are added by the planner for the best of these).
    Empty without GPU hosts."""
    if recipe.cluster is None:
        return []
    p, hosts = recipe.placement_or_default(), recipe.cluster.hosts_by_id()
    g, count = hosts[p.inference[0]].gpus, count or len(p.inference)
    if not g:
        return []
    out = [Layout(describe(g, 1, 1), count, 1, g, 1, True)]
    for h in (d for d in range(1, count + 1) if count % d == 0):
        out.append(Layout(describe(g * h, g * h, h), count // h, h, g * h, g * h, True))
    return out


def weight_bytes(recipe: Recipe) -> float:
    """Bytes per served parameter: FP8 with one fp32 scale per 128x128 block, or the serving dtype."""
    if recipe.inference.fp8:
        return 1 + 4 / kv.FP8_BLOCK ** 2
    return 2 if recipe.inference.dtype == "bfloat16" else 4


def mtp_layer(c: dict, n: Counts) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters of the model's MTP layer: one MoE decoder layer plus the
    projection of [embedding; hidden] and its norms; embeddings and head are shared with the model.
    GLM-5 ships one (its config's num_nextn_predict_layers; 1 when absent). (0, 0) for other models."""
    if not kv.is_dsa(c) or not c.get("num_nextn_predict_layers", 1):
        return 0, 0
    h = c["hidden_size"]
    return n.layers[-1] + 2 * h * h + 3 * h, (routed_experts(c) or 0) * n.expert_size


def experts_per_gpu(c: dict, layout: Layout) -> int:
    """Routed experts of one layer on one GPU (redundant slots fill an uneven split, as vLLM's EPLB)."""
    return math.ceil((routed_experts(c) or 0) / layout.ep_size)


def serving_weights(recipe: Recipe, c: dict, n: Counts, layout: Layout) -> dict[str, float]:
    """Weight bytes on one GPU: non-expert weights split over TP only; routed experts over EP."""
    wb, tp = weight_bytes(recipe), layout.tp
    moe_layers = sum(1 for e in n.experts if e)
    out = {f"embeddings + head (bf16, over TP{tp})": (n.embed + n.head) * 2 / tp,
           f"attention, shared experts, dense layers ({wb:.0f} B/param, over TP{tp})":
               (n.dense - n.embed - n.head + n.buffers) * wb / tp,
           f"routed experts ({experts_per_gpu(c, layout)} of {routed_experts(c) or 0} a layer, {wb:.0f} B/param)":
               experts_per_gpu(c, layout) * moe_layers * n.expert_size * wb}
    if recipe.inference.mtp_tokens:
        dense, _ = mtp_layer(c, n)
        out["MTP layer (one MoE layer, its experts split as the others)"] = \
            (dense / tp + experts_per_gpu(c, layout) * n.expert_size) * wb
    return out


def runtime_memory(recipe: Recipe, c: dict, layout: Layout, longest: float) -> dict[str, float]:
    """What a GPU needs at run time besides weights and KV: captured CUDA graphs, the expert
    all-to-all buffers (every rank's tokens for each local expert: dispatch in FP8, combine in bf16),
    and the activation peak of one chunked-prefill step (its routed rows, and the DSA indexer's
    scores for one block of queries against `longest` keys)."""
    inf, pl, h = recipe.inference, recipe.plan, c["hidden_size"]
    k, inter = c["num_experts_per_tok"], c["moe_intermediate_size"]
    out = {"CUDA graphs (plan.cuda_graphs_gb)": pl.cuda_graphs_gb * GB} if inf.backend == "vllm" else {}
    if layout.dp > 1 and layout.ep_size > 1:
        per_rank = inf.max_batch_size * (1 + inf.mtp_tokens)
        out["expert all-to-all buffers"] = experts_per_gpu(c, layout) * layout.ep_size * per_rank * h * 3
    chunk = float((inf.vllm or {}).get("max_num_batched_tokens", 8192))
    peak = chunk * (k * (h + 3 * inter / layout.tp) * pl.expert_imbalance + 4 * h) * 2
    if kv.is_dsa(c):
        peak += min(pl.indexer_block, chunk) * longest * 4
    out[f"activation peak (a prefill chunk of {chunk:.0f} tokens)"] = peak
    return out


def kv_capacity(recipe: Recipe, c: dict, n: Counts, layout: Layout, context: float,
                longest: float) -> tuple[dict[str, float], float]:
    """One GPU's memory (weights, runtime, KV cache filling the rest) and the sequences of `context`
    tokens each attention replica holds (`longest`: the longest context, for the prefill peak)."""
    items = {**serving_weights(recipe, c, n, layout), **runtime_memory(recipe, c, layout, longest)}
    usable = recipe.plan.gpu_memory_gb * recipe.plan.memory_headroom * GB
    free = usable - sum(items.values())
    fp8 = recipe.inference.kv_cache_dtype == "fp8"
    fits = kv.sequences_that_fit(free, c, fp8, context, layout.tp)
    share = "replicated on every TP GPU" if kv.replicated(c) and layout.tp > 1 else "its own on each GPU"
    items[f"KV cache ({'fp8' if fp8 else 'bf16'}, {share}): {fits:.1f} sequences of {context / 1e3:.1f}k tokens"] = \
        max(free, 0.0)
    return items, fits

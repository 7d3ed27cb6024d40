"""The trainer's memory per GPU and its time per step.

Memory: weights, gradients and Adam state in fp32 (16 bytes a parameter): routed experts split over
`ep` (replicated over the rest), everything else split by FSDP over all ranks; FSDP's working set
(two decoder layers gathered in the compute dtype, one layer's fp32 gradients); activations for the
micro-batch's tokens on this rank (micro_batch_tokens / cp): with checkpointing each layer keeps its
input and one layer is recomputed in full (`layer_activation_bytes`, a tensor-by-tensor count that
assumes fused attention and indexer kernels, which never materialise score matrices), the expert
all-to-all's send buffers and the busiest EP rank's extra rows (plan.expert_imbalance); the DSA
indexer's scores for one block of queries; one chunk of logits.

Time: GEMMs (6 x active parameters x tokens, one more forward with checkpointing; FP8 GEMMs at the
FP8 peak with trainer.fp8, the busiest EP rank's experts at plan.expert_imbalance), sparse attention,
and the indexer (not trained: forward and recompute only; the last context-parallel rank of a
contiguous split scores (2cp - 1) / cp of the mean, zigzag evens it), all at plan.mfu; the expert
all-to-all, FSDP and CP collectives and the weight send over NVLink and the network.

Under LoRA (`trainer.lora`) the weights, the GEMMs and FSDP's exchanges change as `prl.sizing.lora`
says: a frozen base without gradients or Adam, no weight gradients for it (6 of 8 GEMM FLOPs a
parameter and token with checkpointing), the adapters trained in full.
"""

from __future__ import annotations

from prl.model.families import routed_experts
from prl.recipe.schema import Recipe, measured_overlap
from prl.sizing import kv, lora
from prl.sizing.params import Counts
from prl.sizing.workload import Workload

GB = 1e9


def compute_bytes(recipe: Recipe) -> int:
    return 2 if recipe.trainer.dtype == "bfloat16" else 4


def layer_activation_bytes(c: dict, tokens: float, cb: int) -> float:
    """Everything one decoder layer keeps for backward, for `tokens` tokens (MoE layer)."""
    h, k = c["hidden_size"], c["num_experts_per_tok"]
    inter = c["moe_intermediate_size"]
    if kv.is_dsa(c):
        heads, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        attn = (c["q_lora_rank"] * 2 + heads * qk * 2 + (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2
                + heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) + heads * c["v_head_dim"] * 2
                + c["index_n_heads"] * c["index_head_dim"] + c["index_head_dim"] + c["index_n_heads"])
        shared = 3 * inter * c.get("n_shared_experts", 1)
    else:
        heads, kvh = c["num_attention_heads"], c["num_key_value_heads"]
        hd = c.get("head_dim") or h // heads
        attn = heads * hd * 3 + kvh * hd * 4 + heads * hd + (heads + kvh) * hd  # projections, q/k norms, output
        shared = 0
    experts = routed_experts(c)
    # per routed (token, slot) row: its input, gate/up (2I), activation and product (2I), output and
    # weighted output (2h); the router's logits and scores (2E)
    routed = k * (3 * h + 4 * inter) + 2 * experts
    per_token = 4 * h + attn + routed + shared  # norms/residuals, attention, experts
    return tokens * per_token * cb


def trainer_memory(recipe: Recipe, c: dict, n: Counts, world: int, as_built: bool = False) -> dict[str, float]:
    """`as_built`: under LoRA, the frozen base at trainer.dtype as the trainer holds it (no FP8 base yet;
    `prl.sizing.lora`)."""
    t, par, cb = recipe.trainer, recipe.trainer.parallel, compute_bytes(recipe)
    tokens = t.micro_batch_tokens / par.cp
    layers, h, k = c["num_hidden_layers"], c["hidden_size"], c["num_experts_per_tok"]
    act_layer = layer_activation_bytes(c, tokens, cb)
    acts = layers * tokens * h * cb + act_layer if t.activation_checkpointing else layers * act_layer
    chunk = t.logprob_chunk_tokens or tokens
    rows = tokens * k
    out = lora.weight_memory(recipe, c, n, world, fp8_dense(c, n), as_built) if t.lora.enabled else {
        "weights+grads+Adam, experts (16 B/param over ep)": n.routed / par.ep * 16,
        "weights+grads+Adam, the rest (16 B/param over all ranks)": n.dense / world * 16 + n.buffers * 4,
        "FSDP working set (2 layers gathered + 1 layer of grads)": n.largest_layer * (2 * cb + 4),
    }
    out.update({
        "activations" + (" (checkpointed layers + 1 recomputed)" if t.activation_checkpointing else " (every layer)"): acts,
        "expert all-to-all send buffers (one layer's rows out and back)": 2 * rows * h * cb,
        "expert imbalance (the busiest EP rank's extra routed rows, one layer)":
            (recipe.plan.expert_imbalance - 1) * rows * (3 * h + 4 * c["moe_intermediate_size"]) * cb,
        "logprob chunk (logits, softmax, grad)": chunk * c["vocab_size"] * 4 * 3,
    })
    if t.loss.kl_coef and not t.lora.enabled:  # under LoRA the reference is the base, adapters off
        out["KL reference weights (frozen, sharded as the policy)"] = (n.routed / par.ep + n.dense / world) * cb
    if kv.is_dsa(c):
        block = min(ATTENTION_BLOCK, tokens)
        # the scores summed so far and one head's, the masked copy, the sort's values and int64 indices
        out["DSA indexer (one query block x all keys: scores, masked copy, sort)"] = block * t.micro_batch_tokens * 24
        out["CP visibility mask (local queries x keys, bool)"] = tokens * t.micro_batch_tokens
        out["DSA sparse attention (one query block in backward: its picks' rows, scores, weights, grads)"] = \
            sparse_block_bytes(c, block, t.micro_batch_tokens, cb)
    return out


ATTENTION_BLOCK = 1024  # queries per block of prl's context-parallel DSA attention (`query_blocks`)


def sparse_block_bytes(c: dict, queries: float, keys: float, cb: int) -> float:
    """What `prl.trainer.context_parallel.attend_sparse` holds for one block of queries in backward
    (recomputed per block): each query's top-k latent rows and their gradient, fp32 scores, weights
    and the scores' gradient per head, and the gradient of every key's latent row the gather adds into."""
    picks, row = queries * c["index_topk"], c["kv_lora_rank"] + c["qk_rope_head_dim"]
    return 2 * picks * row * cb + 3 * picks * c["num_attention_heads"] * 4 + keys * row * cb


def fp8_dense(c: dict, n: Counts) -> float:
    """Parameters outside the routed experts whose GEMMs trainer.fp8 runs in FP8: shared experts, dense
    MLPs and attention projections whose two dimensions are multiples of 128 (not the router, the
    indexer, GLM-5's 576-wide kv_a projection, the head)."""
    h = c["hidden_size"]
    if kv.is_dsa(c):
        heads, q, lora_rank = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
        shapes = [(h, q), (q, heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"])),
                  (h, lora_rank + c["qk_rope_head_dim"]), (lora_rank, heads * (c["qk_nope_head_dim"] + c["v_head_dim"])),
                  (heads * c["v_head_dim"], h)]
    else:
        hd = c.get("head_dim") or h // c["num_attention_heads"]
        q, kvd = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
        shapes = [(h, q), (h, kvd), (h, kvd), (q, h)]
    attn = sum(a * b for a, b in shapes if a % 128 == 0 and b % 128 == 0) * c["num_hidden_layers"]
    shared = 3 * h * c["moe_intermediate_size"] * c.get("n_shared_experts", 0) if kv.is_dsa(c) else 0
    return attn + sum(shared if e else 3 * h * c["intermediate_size"] for e in n.experts)


def fp8_active(c: dict, n: Counts) -> float:
    """Active parameters per token in GEMMs that trainer.fp8 runs in FP8: `fp8_dense` and the routed
    experts a token is sent to."""
    return fp8_dense(c, n) + sum(1 for e in n.experts if e) * n.top_k * n.expert_size


def cp_imbalance(cp: int, layout: str) -> float:
    """The busiest context-parallel rank's indexer (query, key) pairs over the mean, for a causal row
    split in cp parts: contiguous slices give the last rank (2cp - 1) / cp (1.875 at cp = 8); zigzag
    (chunk c and its mirror 2cp - 1 - c of 2cp chunks) gives every rank the same."""
    return 1.0 if cp == 1 or layout == "zigzag" else (2 * cp - 1) / cp


def compute_seconds(recipe: Recipe, c: dict, n: Counts, w: Workload, world: int) -> dict[str, float]:
    """Seconds of compute per step on the busiest rank, by part."""
    t, pl = recipe.trainer, recipe.plan
    tokens = w.batch * w.mean
    passes = 4 if t.activation_checkpointing else 3  # forward, backward (2x), recomputed forward
    bf16 = world * pl.gpu_tflops * 1e12 * pl.mfu
    fp8 = world * pl.fp8_tflops * 1e12 * pl.mfu
    extra = sum(1 for e in n.experts if e) * n.top_k * n.expert_size * (pl.expert_imbalance - 1)

    def flops(params: float, gemm_passes: int) -> float:
        return 2 * params * tokens * gemm_passes

    base = lora.backward_passes(recipe, passes)  # LoRA: the frozen base computes no weight gradients
    if t.fp8:
        low = fp8_active(c, n)
        out = {"GEMMs in FP8 (experts at the busiest EP rank)": flops(low + extra, base) / fp8,
               "GEMMs in bf16 (router, indexer, kv_a, head)": flops(n.active - low, base) / bf16}
    else:
        out = {"GEMMs (experts at the busiest EP rank)": flops(n.active + extra, base) / bf16}
    if t.lora.enabled:
        out["GEMMs of the LoRA adapters (bf16)"] = flops(lora.active_adapters(c, n, t.lora), passes) / bf16
    if kv.is_dsa(c):
        keys = w.token_weighted / 2  # a token's earlier keys, token-weighted
        per_key = 2 * c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"])
        out["sparse attention"] = tokens * per_key * min(c["index_topk"], keys) * c["num_hidden_layers"] * passes / bf16
        idx = tokens * 2 * c["index_n_heads"] * c["index_head_dim"] * keys * kv.indexer_layers(c) * (passes - 2) / bf16
        layout = getattr(t.parallel, "cp_layout", "contiguous")
        out[f"indexer (x{cp_imbalance(t.parallel.cp, layout):.3f}: busiest CP rank, {layout})"] = \
            idx * cp_imbalance(t.parallel.cp, layout)
    return out


def dedup_factor(hosts: int, k: int) -> float:
    """Off-host dispatch bytes with node-level deduplication over without, for uniform routing over
    `hosts` hosts: a token goes once to each other host holding any of its k experts (then spreads
    inside it over NVLink) instead of once per expert there."""
    if hosts <= 1:
        return 1.0
    remote_slots = k * (hosts - 1) / hosts
    distinct_hosts = (hosts - 1) * (1 - (1 - 1 / hosts) ** k)
    return distinct_hosts / remote_slots


def split_link(total: float, span: int, per_host: int, net: float, nvlink: float) -> float:
    """Seconds to move `total` bytes spread evenly over `span` ranks, per_host of them on this host."""
    off = 0.0 if span <= per_host else 1 - per_host / span
    return total * off / net + total * (1 - off) / nvlink


def comm_seconds(recipe: Recipe, c: dict, n: Counts, w: Workload, world: int) -> dict[str, float]:
    """Seconds of communication per step on the busiest rank. Expert all-to-all: dispatch and combine
    in forward, recompute and backward, the busiest rank receiving plan.expert_imbalance x the mean; with
    plan.fp8_dispatch the half travelling toward the experts goes in FP8 (1 byte + a scale per 128),
    with plan.node_dedup once per host. FSDP: gathers and reduce-scatters of the non-expert weights.
    CP: one all-gather of each token's latent, rope and indexer keys per layer (its backward, a
    reduce-scatter)."""
    t, par, pl, cb = recipe.trainer, recipe.trainer.parallel, recipe.plan, compute_bytes(recipe)
    tokens, passes = w.batch * w.mean, 4 if t.activation_checkpointing else 3
    net, nvl, per_host = pl.network_gb_s * 1e9, pl.nvlink_gb_s * 1e9, t.nproc
    value = (cb + 1 + 4 / kv.FP8_BLOCK) / 2 if pl.fp8_dispatch else cb
    a2a = sum(1 for e in n.experts if e) * tokens / world * n.top_k * c["hidden_size"] * value * 2 * (passes - 1)
    a2a *= pl.expert_imbalance
    dedup = dedup_factor(max(1, par.ep // per_host), n.top_k) if pl.node_dedup else 1.0
    off = 0.0 if par.ep <= per_host else 1 - per_host / par.ep
    # FSDP gathers the weights twice (forward, backward) and reduce-scatters fp32 gradients: under LoRA the
    # adapters' alone
    shard = n.dense / world * (world - 1) * (2 * cb + (0 if t.lora.enabled else 4))
    shard += lora.adapters(c, n, t.lora)[0] / world * (world - 1) * 4 if t.lora.enabled else 0
    out = {"expert all-to-all": a2a * off * dedup / net + a2a * (1 - off) / nvl,
           "FSDP gathers + reduce-scatters": shard / (net if world > per_host else nvl)}
    if par.cp > 1 and kv.is_dsa(c):
        per_token = (c["kv_lora_rank"] + c["qk_rope_head_dim"] + c["index_head_dim"]) * cb
        gathered = c["num_hidden_layers"] * tokens / (world / par.cp) * per_token * (par.cp - 1) / par.cp * (passes - 1)
        out["CP all-gathers (one per DSA layer)"] = split_link(gathered, par.cp, per_host, net, nvl)
    return out


def micro_batches(recipe: Recipe, w: Workload, world: int) -> float:
    """Micro-batches each rank runs per step."""
    par = recipe.trainer.parallel
    return w.batch * w.mean / (recipe.trainer.micro_batch_tokens * world / par.cp)


HIDDEN = ("expert all-to-all", "CP all-gathers")  # the exchanges trainer.parallel.overlap puts behind compute


def overlapped(compute: float, comm: dict[str, float], efficiency: float) -> float:
    """A step's time: compute plus communication, less `efficiency` x min(compute, the exchanges the
    trainer overlaps: `HIDDEN`) where trainer.parallel.overlap is on (else pass 0)."""
    hideable = sum(v for k, v in comm.items() if k.startswith(HIDDEN))
    return compute + sum(comm.values()) - efficiency * min(compute, hideable)


def step_seconds(recipe: Recipe, compute: dict[str, float], comm: dict[str, float], send: float) -> float:
    """The trainer's step: compute and exchanges, overlapped as trainer.parallel.overlap says, and the weight send
    `send`: beside the next step where trainer.publish_overlap (the step then lasts at least as long), else after."""
    if recipe.trainer.publish_overlap:
        return max(overlapped(sum(compute.values()), comm, overlap_efficiency(recipe)), send)
    return overlapped(sum(compute.values()), {**comm, "weight send": send}, overlap_efficiency(recipe))


def overlap_efficiency(recipe: Recipe) -> float:
    """The efficiency the plan counts: plan.overlap_efficiency, else the bench's for the recipe's overlap mode; 0
    where the trainer's overlap is off."""
    par = recipe.trainer.parallel
    if not par.overlap:
        return 0.0
    given = recipe.plan.overlap_efficiency
    return given if given is not None else measured_overlap(par.overlap, par.overlap_parts)

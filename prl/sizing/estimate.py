"""`prl plan RECIPE`: will the recipe fit, and how long should a step take? (no torch)

Memory per trainer GPU, from the parameter counts (`prl.sizing.params`) and the parallel layout:
- weights, gradients and Adam state in fp32 (16 bytes a parameter): routed experts split over `ep`
  (replicated over the rest), everything else split by FSDP over all ranks;
- FSDP's working set: two decoder layers gathered in the compute dtype (one computing, one
  prefetched) and one layer's full gradients in fp32;
- activations for the micro-batch's tokens on this rank (micro_batch_tokens / cp): with activation
  checkpointing each layer keeps its input and one layer at a time is recomputed in full; without,
  every layer keeps everything (`layer_activation_bytes`, a tensor-by-tensor count that assumes
  fused attention and fused sparse-attention kernels, which never materialise score matrices);
  the DSA indexer's scores for one block of queries against every key; one chunk of logits.
Memory per inference GPU: the weights (bf16, or FP8) over the server's GPUs, and the KV cache of
`inference.max_batch_size` sequences of mean length (MLA latent + rope key + indexer key for GLM-5).

Step time: trainer FLOPs (6 x active parameters x tokens, one more forward with checkpointing,
plus sparse attention and the indexer's dense scores) at `plan.mfu` of peak; the expert all-to-all,
FSDP gathers and reduce-scatters and the CP all-gathers over NVLink (inside a host) and the network
(between hosts); rollout time from decode steps bound by HBM bandwidth (weights + KV read per step)
and prefill FLOPs. The orchestrator runs ahead, so a step takes about max(trainer, rollout).
Every assumption is a `[plan]` key, printed with the result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from prl.model.families import routed_experts
from prl.recipe.schema import Recipe
from prl.sizing.params import Counts, count

GB = 1e9
BUILTIN = Path(__file__).with_name("glm5_config.json")


def model_config(recipe: Recipe) -> tuple[dict, str]:
    """The model's config.json: the folder's when it is on this machine, else (GLM-5 family) the
    GLM-5 defaults shipped with prl, else the tiny model the recipe builds."""
    m = recipe.model
    if m.path:
        cfg = Path(m.path).expanduser() / "config.json"
        if cfg.is_file():
            return json.loads(cfg.read_text()), str(cfg)
        if m.arch == "glm_moe_dsa":
            return json.loads(BUILTIN.read_text()), f"{BUILTIN.name} (GLM-5; {cfg} is not on this machine)"
        raise ValueError(f"prl plan: {cfg} is not on this machine; run prl plan where the model folder is")
    from prl.model.tiny import CHARS, SPECIALS, tiny_config

    return tiny_config(m, len(SPECIALS) + len(CHARS)).to_dict(), f"the tiny {m.arch} model of [model]"


@dataclass
class Plan:
    config_source: str
    counts: Counts
    world: int
    trainer: dict[str, float] = field(default_factory=dict)  # bytes per GPU, by item
    inference: dict[str, float] = field(default_factory=dict)
    time: dict[str, float] = field(default_factory=dict)  # seconds
    facts: dict[str, object] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def compute_bytes(recipe: Recipe) -> int:
    return 2 if recipe.trainer.dtype == "bfloat16" else 4


def lengths(recipe: Recipe) -> tuple[float, float]:
    """Mean prompt and completion tokens per sample."""
    prompt = recipe.plan.prompt_tokens or recipe.longest_sample() - recipe.sampling.max_tokens
    return float(prompt), recipe.plan.completion_fraction * recipe.sampling.max_tokens


def layer_activation_bytes(c: dict, tokens: float, cb: int) -> float:
    """Everything one decoder layer keeps for backward, for `tokens` tokens (MoE layer)."""
    h, k = c["hidden_size"], c["num_experts_per_tok"]
    inter = c["moe_intermediate_size"]
    if c.get("model_type") == "glm_moe_dsa":
        heads, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        attn = (c["q_lora_rank"] * 2 + heads * qk * 2 + (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2
                + heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) + heads * c["v_head_dim"] * 2
                + c["index_n_heads"] * c["index_head_dim"] + c["index_head_dim"] + c["index_n_heads"])
        shared = 3 * inter * c.get("n_shared_experts", 1)
    else:
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        hd = c.get("head_dim") or h // heads
        attn = heads * hd * 3 + kv * hd * 4 + heads * hd + (heads + kv) * hd  # projections, q/k norms, output
        shared = 0
    experts = routed_experts(c)
    # per routed (token, slot) row: its input, gate/up (2I), activation and product (2I), output and
    # weighted output (2h); the router's logits and scores (2E)
    routed = k * (3 * h + 4 * inter) + 2 * experts
    per_token = 4 * h + attn + routed + shared  # norms/residuals, attention, experts
    return tokens * per_token * cb


def kv_bytes_per_token(c: dict) -> int:
    if c.get("model_type") == "glm_moe_dsa":
        per_layer = (c["kv_lora_rank"] + c["qk_rope_head_dim"] + c["index_head_dim"]) * 2
    else:
        per_layer = 2 * c["num_key_value_heads"] * (c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]) * 2
    return per_layer * c["num_hidden_layers"]


def trainer_memory(recipe: Recipe, c: dict, n: Counts, world: int) -> dict[str, float]:
    t, par, cb = recipe.trainer, recipe.trainer.parallel, compute_bytes(recipe)
    tokens = t.micro_batch_tokens / par.cp
    layers = c["num_hidden_layers"]
    act_layer = layer_activation_bytes(c, tokens, cb)
    if t.activation_checkpointing:
        acts = layers * tokens * c["hidden_size"] * cb + act_layer
    else:
        acts = layers * act_layer
    chunk = t.logprob_chunk_tokens or tokens
    out = {
        "weights+grads+Adam, experts (16 B/param over ep)": n.routed / par.ep * 16,
        "weights+grads+Adam, the rest (16 B/param over all ranks)": n.dense / world * 16 + n.buffers * 4,
        "FSDP working set (2 layers gathered + 1 layer of grads)": n.largest_layer * (2 * cb + 4),
        "activations" + (" (checkpointed layers + 1 recomputed)" if t.activation_checkpointing else " (every layer)"): acts,
        "logprob chunk (logits, softmax, grad)": chunk * c["vocab_size"] * 4 * 3,
    }
    if c.get("model_type") == "glm_moe_dsa":
        out["DSA indexer scores (one query block x all keys, fp32)"] = min(recipe.plan.indexer_block, tokens) * t.micro_batch_tokens * 4
    return out


def servers(recipe: Recipe) -> tuple[int, int]:
    """(number of inference servers, GPUs per server)."""
    per = recipe.placement_or_default().gpus_per_server if recipe.cluster is not None else 1
    return recipe.server_count(), per


def inference_memory(recipe: Recipe, c: dict, n: Counts) -> dict[str, float]:
    _, gpus = servers(recipe)
    prompt, completion = lengths(recipe)
    weight_bytes = 1 if recipe.inference.fp8 else 2
    kv = recipe.inference.max_batch_size * (prompt + completion / 2) * kv_bytes_per_token(c)
    return {f"weights ({weight_bytes} B/param over {gpus} GPUs)": n.total * weight_bytes / gpus,
            f"KV cache ({recipe.inference.max_batch_size} sequences of mean length)": kv / gpus}


def step_time(recipe: Recipe, c: dict, n: Counts, world: int) -> tuple[dict[str, float], dict]:
    t, par, pl, cb = recipe.trainer, recipe.trainer.parallel, recipe.plan, compute_bytes(recipe)
    prompt, completion = lengths(recipe)
    sample = prompt + completion
    tokens = recipe.rl.batch_size * sample
    passes = 4 if t.activation_checkpointing else 3  # forward, backward (2x), recomputed forward
    layers, h = c["num_hidden_layers"], c["hidden_size"]
    attn = 0.0
    if c.get("model_type") == "glm_moe_dsa":
        ctx = min(c["index_topk"], sample / 2)
        attn = 2 * c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) * ctx
        attn += 2 * c["index_n_heads"] * c["index_head_dim"] * sample / 2  # the indexer scores every earlier key
    flops = tokens * (2 * n.active + layers * attn) * passes
    gpu_flops = pl.gpu_tflops * 1e12 * pl.mfu
    per_host = t.nproc
    moe_layers = sum(1 for e in n.experts if e)
    rows = tokens / world * n.top_k * h * cb  # one exchange's bytes per rank
    a2a = moe_layers * rows * 2 * (passes - 1)  # dispatch + combine in forward, backward, recompute
    off_host = 0.0 if par.ep <= per_host else 1 - per_host / par.ep
    fsdp = n.dense / world * (world - 1) * (2 * cb + 4)  # gather (fwd, bwd) and reduce-scatter, this rank's link
    cp_bytes = 0.0
    if par.cp > 1 and c.get("model_type") == "glm_moe_dsa":
        per_token = (c["kv_lora_rank"] + c["qk_rope_head_dim"] + c["index_head_dim"]) * cb
        cp_bytes = layers * tokens / (world / par.cp) * per_token * (par.cp - 1) / par.cp * (passes - 1)
    net = pl.network_gb_s * GB
    comm = {"expert all-to-all": a2a * off_host / net + a2a * (1 - off_host) / (pl.nvlink_gb_s * GB),
            "FSDP gathers + reduce-scatters": fsdp / (net if world > per_host else pl.nvlink_gb_s * GB),
            "CP all-gathers (one per DSA layer)": cp_bytes / (pl.nvlink_gb_s * GB if par.cp <= per_host else net)}
    compute = flops / (world * gpu_flops)
    trainer = compute + (0 if pl.overlap_comm else sum(comm.values()))
    n_servers, gpus = servers(recipe)
    per_server = recipe.rl.batch_size / n_servers
    batch = min(recipe.inference.max_batch_size, per_server)
    weight_read = min(n.total, n.dense + batch * n.top_k * n.expert_size * moe_layers) * (1 if recipe.inference.fp8 else 2)
    kv_read = batch * (prompt + completion / 2) * kv_bytes_per_token(c)
    decode_step = (weight_read + kv_read) / (gpus * pl.hbm_tb_s * 1e12 * pl.decode_efficiency)
    decode = per_server / batch * completion * decode_step
    prefill = per_server / recipe.rl.group_size * prompt * 2 * n.active / (gpus * gpu_flops)  # a group shares its prompt
    times = {"trainer compute": compute, **{f"trainer {k}": v for k, v in comm.items()},
             "trainer step": trainer, "rollout decode": decode, "rollout prefill": prefill,
             "rollout step": decode + prefill, "step (async: the slower of the two)": max(trainer, decode + prefill)}
    facts = {"tokens per step": tokens, "trainer FLOPs per step": flops, "decode batch per server": batch,
             "decode step": decode_step, "inference servers": n_servers}
    return times, facts


def make_plan(recipe: Recipe) -> Plan:
    c, source = model_config(recipe)
    n = count(c)
    world = recipe.trainer_world()
    plan = Plan(source, n, world)
    plan.trainer = trainer_memory(recipe, c, n, world)
    plan.inference = inference_memory(recipe, c, n)
    plan.time, plan.facts = step_time(recipe, c, n, world)
    usable = recipe.plan.gpu_memory_gb * recipe.plan.memory_headroom * GB
    for what, items in (("trainer", plan.trainer), ("inference", plan.inference)):
        need = sum(items.values())
        if need > usable:
            top = max(items, key=items.get)
            plan.problems.append(f"a {what} GPU needs {need / GB:.1f} GB, more than the {usable / GB:.1f} GB usable "
                                 f"(plan.gpu_memory_gb x plan.memory_headroom); largest item: {top} "
                                 f"{items[top] / GB:.1f} GB")
    return plan


def minutes(s: float) -> str:
    return f"{s / 60:.2f} min" if s >= 60 else f"{s:.2f} s"


def format_plan(recipe: Recipe, plan: Plan) -> str:
    n, par = plan.counts, recipe.trainer.parallel
    lines = [f"model: {plan.config_source}",
             f"  parameters {n.total / 1e9:.3f} B ({n.routed / 1e9:.3f} B in routed experts), active per token "
             f"{n.active / 1e9:.3f} B",
             f"trainer: {plan.world} ranks, dp_shard x cp = {plan.world // par.cp} x {par.cp}, ep = {par.ep}, "
             f"{recipe.trainer.dtype}, activation checkpointing {'on' if recipe.trainer.activation_checkpointing else 'off'}"]
    for title, items in (("trainer GPU memory", plan.trainer), ("inference GPU memory", plan.inference)):
        lines.append(f"{title}: {sum(items.values()) / GB:.1f} GB")
        lines += [f"  {v / GB:8.2f} GB  {k}" for k, v in items.items()]
    lines.append("step time:")
    lines += [f"  {minutes(v):>11}  {k}" for k, v in plan.time.items()]
    lines.append("facts: " + ", ".join(f"{k} {v:.3g}" for k, v in plan.facts.items()))
    lines.append("assumptions ([plan], settable with --set plan.KEY=VALUE): "
                 + ", ".join(f"{k} = {v}" for k, v in recipe.plan.model_dump().items()))
    lines += [f"DOES NOT FIT: {p}" for p in plan.problems] or ["fits: every GPU within its usable memory"]
    return "\n".join(lines)


def summary(plan: Plan) -> str:
    verdict = "DOES NOT FIT" if plan.problems else "fits"
    return (f"prl plan: {verdict}; trainer GPU {sum(plan.trainer.values()) / GB:.1f} GB, inference GPU "
            f"{sum(plan.inference.values()) / GB:.1f} GB, step about {minutes(plan.time['step (async: the slower of the two)'])} "
            f"(`prl plan RECIPE` for the breakdown and assumptions)")

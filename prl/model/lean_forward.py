"""A lean forward for the embedded engine: the model's own modules, none of transformers' per-call
machinery.

On a small model most of a step through `model(...)` is not the products but what wraps them: the
causal-mask builder, the output classes, keyword plumbing through decorators, RMSNorm as seven ops.
`forward_for(model)` returns a function computing the same math for the engine's forwards (decode
steps over its right-aligned batch cache, `prl.inference.kvcache`, and left-padded or prefix-extending
prefills), or None where the family has none (the engine then calls the model). It calls the model's
leaf modules (projections, routers, experts, embedding, rotary, head), so what prl swaps into them
(FP8 linears, R3's capture hooks on the routers) still applies; only HF's plain experts on the CPU
are computed here, with the grouped product their own forward uses.

The trainer's forward runs the same layer functions (`qwen3_moe_layer`, `glm_moe_dsa_layer`) with
gradients and without a cache, through the model's own module calls (`prl.trainer.lean`).

Qwen3-MoE and GLM-5 have one (`FamilySpec.lean_forward`, `FORWARDS`): Qwen3-MoE's attention is
computed here; GLM-5 calls its attention module as it is (prl's latent decode, `prl.model.mla`, with
the DSA indexer) with one boolean mask. Equality with the model's forward is tested, FP8 layers
swapped in too (`tests/test_engine.py`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from prl.model.families import FAMILIES


def forward_for(model):
    """`forward(ids [B, S], positions [B, S], cache | None, mask [B, P + S] bool) -> (logits [B, S, V],
    cache)`: the S new tokens of each row after the P the cache holds (None: a new cache), `mask` True
    at real tokens (rows right-aligned); each layer's keys and values appended to the cache. None where
    no lean forward fits the model."""
    return functools.partial(FORWARDS[model.config.model_type], model) if fits(model) else None


def fits(model) -> bool:
    """Whether the lean forwards (the engine's, `prl.trainer.lean`'s) compute what the model's forward does."""
    cfg = model.config
    fam = FAMILIES.get(cfg.model_type)
    if fam is None or not fam.lean_forward or cfg.model_type not in FORWARDS:
        return False
    if getattr(cfg, "use_sliding_window", False) or any("sliding" in t for t in getattr(cfg, "layer_types", None) or ()):
        return False  # sliding-window layers keep another cache layout and mask
    # the attention (computed here for Qwen3-MoE, GLM-5's module as it is) takes a mask as sdpa and eager do;
    # flash and flex take theirs another way
    return cfg._attn_implementation in ("sdpa", "eager")


def rms_norm(mod, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm (statistics in fp32, the weight applied in the input's dtype): one op for fp32."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, mod.weight.shape, mod.weight, mod.variance_epsilon)
    return mod.weight * torch.rms_norm(x.float(), mod.weight.shape, None, mod.variance_epsilon).to(x.dtype)


def linear(mod, x: torch.Tensor) -> torch.Tensor:
    """A plain `nn.Linear` without the module call; anything prl swapped in (FP8) or hooked through its own call."""
    if type(mod) is torch.nn.Linear and not (mod._forward_hooks or mod._forward_pre_hooks):
        return F.linear(x, mod.weight, mod.bias)
    return mod(x)


def visible(mask: torch.Tensor, new: int) -> torch.Tensor:
    """[B, S, P + S] bool: a new token sees the real tokens up to itself, and itself always (a padding
    row then stays finite: its keys and values are masked out of every real row)."""
    T = mask.shape[1]
    key = torch.arange(T, device=mask.device)
    query = torch.arange(T - new, T, device=mask.device)[:, None]
    return (mask[:, None, :] & (key <= query)) | (key == query)


def attention_bias(mask: torch.Tensor, new: int) -> torch.Tensor:
    """`visible` as a [B, 1, 1, S, P + S] additive bias."""
    seen = visible(mask, new)
    bias = torch.zeros(seen.shape, dtype=torch.float32, device=mask.device).masked_fill_(~seen, float("-inf"))
    return bias[:, None, None]


@torch.no_grad()
def qwen3_moe_forward(model, ids: torch.Tensor, positions: torch.Tensor, cache, mask: torch.Tensor):
    from transformers import DynamicCache

    m = model.model
    if cache is None:
        cache = DynamicCache(config=model.config)
    h = m.embed_tokens(ids)  # [B, S, H]
    rope = qwen3_rope(m, h, positions)
    if model.config._attn_implementation == "sdpa":  # the kernel transformers' forward runs, for its rounding
        bias = visible(mask.to(h.device), ids.shape[1])[:, None]  # [B, 1, S, T] bool
    else:
        bias = attention_bias(mask.to(h.device), ids.shape[1])
    for i, layer in enumerate(m.layers):
        h = qwen3_moe_layer(layer, h, rope, bias, cache.layers[i])
    return linear(model.lm_head, rms_norm(m.norm, h)), cache


def qwen3_rope(m, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, 1, S, D] of Qwen3-MoE's rotary embedding, broadcast over heads, sin signed so that
    `x.roll(D // 2)` replaces rotate_half."""
    cos, sin = m.rotary_emb(h, positions)  # [B, S, D]
    half = cos.shape[-1] // 2
    sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)
    return cos[:, None], sin[:, None]


def qwen3_moe_layer(layer, h: torch.Tensor, rope, bias: torch.Tensor, kv=None) -> torch.Tensor:
    """One Qwen3-MoE decoder layer (the engine's with its cache layer `kv`, the trainer's without)."""
    h = h + attend(layer.self_attn, rms_norm(layer.input_layernorm, h), rope, bias, kv)
    return h + mlp(layer.mlp, rms_norm(layer.post_attention_layernorm, h))


def attend(a, x: torch.Tensor, rope, bias: torch.Tensor, kv=None) -> torch.Tensor:
    """One layer's GQA attention of S new tokens per row; their keys and values appended to `kv` (None: these
    tokens' own keys and values alone). `bias`: a bool mask (the model runs sdpa: so does this, for the same
    rounding) or an additive one [B, 1, 1, S, T] (products)."""
    B, S, D = x.shape[0], x.shape[1], a.head_dim
    cos, sin = rope
    q = rms_norm(a.q_norm, linear(a.q_proj, x).view(B, S, -1, D)).transpose(1, 2)  # [B, heads, S, D]
    k = rms_norm(a.k_norm, linear(a.k_proj, x).view(B, S, -1, D)).transpose(1, 2)  # [B, kv heads, S, D]
    q = q * cos + q.roll(D // 2, -1) * sin
    k = k * cos + k.roll(D // 2, -1) * sin
    v = linear(a.v_proj, x).view(B, S, -1, D).transpose(1, 2)
    keys, values = (k, v) if kv is None else kv.update(k, v)  # [B, kv heads, T, D]
    groups = q.shape[1] // keys.shape[1]  # query heads per K/V head (transformers' repeat_kv order)
    if bias.dtype == torch.bool:  # sdpa over K/V repeated per query head, as transformers' sdpa path on a CPU
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=a.scaling, enable_gqa=True)
        return linear(a.o_proj, out.transpose(1, 2).reshape(B, S, -1))
    q = q.reshape(B, keys.shape[1], groups * S, D)
    scores = torch.matmul(q, keys.transpose(2, 3)).view(B, keys.shape[1], groups, S, -1) * a.scaling + bias
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(values.dtype).view(B, keys.shape[1], groups * S, -1)
    out = torch.matmul(probs, values).view(B, -1, S, D).transpose(1, 2)  # [B, S, heads, D]
    return linear(a.o_proj, out.reshape(B, S, -1))


def mlp(block, x: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE's MLP: a dense one's three products, an MoE block's routed experts."""
    experts = getattr(block, "experts", None)
    if experts is None:
        return dense_mlp(block, x)
    return routed(block, x.reshape(-1, x.shape[-1])).view(x.shape)


def routed(block, x: torch.Tensor) -> torch.Tensor:
    """An MoE block's routed experts on `x` [N, H]: the router module (R3's hooks see it), then HF's plain
    experts on the CPU as two grouped products, anything else (prl's FP8 swap, a GPU) by its own forward."""
    _, weights, ids = block.gate(x)
    experts = block.experts
    if type(experts).__name__ in PLAIN_EXPERTS and x.device.type == "cpu" and hasattr(torch, "_grouped_mm"):
        return grouped_experts(experts, x, ids, weights)
    return experts(x, ids, weights)


@torch.no_grad()
def glm_moe_dsa_forward(model, ids: torch.Tensor, positions: torch.Tensor, cache, mask: torch.Tensor):
    """GLM-5: the model's decoder layers' parts called directly (its attention module as it is: prl's
    latent decode with the DSA indexer, transformers' expanded attention for a long prefill), with one
    boolean mask for attention and indexer alike."""
    from transformers import DynamicCache

    m = model.model
    if cache is None:
        cache = DynamicCache(config=model.config)
    h = m.embed_tokens(ids)  # [B, S, H]
    rope = m.rotary_emb(h, positions)
    seen = visible(mask.to(h.device), ids.shape[1])[:, None]  # [B, 1, S, T]
    if model.config._attn_implementation == "eager":  # eager attention adds its mask to the scores
        seen = torch.zeros(seen.shape, dtype=h.dtype, device=h.device).masked_fill_(~seen, torch.finfo(h.dtype).min)
    topk = None  # a shared DSA layer reuses the previous indexer layer's selection
    for layer in m.layers:
        h, topk = glm_moe_dsa_layer(layer, h, rope, seen, positions, topk, cache)
    return linear(model.lm_head, rms_norm(m.norm, h)), cache


def glm_moe_dsa_layer(layer, h: torch.Tensor, rope, seen: torch.Tensor, positions: torch.Tensor, topk, cache=None):
    """One GLM-5 decoder layer: (hidden states, the DSA selection a shared layer after it reuses)."""
    out, _, topk = layer.self_attn(rms_norm(layer.input_layernorm, h), rope, seen, cache, positions, topk)
    h = h + out
    x = rms_norm(layer.post_attention_layernorm, h)
    if getattr(layer.mlp, "experts", None) is None:
        return h + dense_mlp(layer.mlp, x), topk
    return h + (routed(layer.mlp, x.reshape(-1, x.shape[-1])).view(x.shape) + dense_mlp(layer.mlp.shared_experts, x)), topk


def dense_mlp(block, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP (gate, up, down and the model's activation) through `linear`; another block by its own call."""
    if type(block).__name__ not in DENSE_MLPS or block._forward_hooks or block._forward_pre_hooks:
        return block(x)
    return linear(block.down_proj, block.act_fn(linear(block.gate_proj, x)) * linear(block.up_proj, x))


def grouped_experts(ex, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """HF's plain stacked experts, their rows sorted by expert into one grouped product each way."""
    k = ids.shape[-1]
    order, perm = torch.sort(ids.reshape(-1))
    ends = torch.cumsum(torch.bincount(order, minlength=ex.num_experts), 0, dtype=torch.int32)
    rows = perm // k
    gate, up = torch._grouped_mm(x[rows], ex.gate_up_proj.transpose(-2, -1), offs=ends).chunk(2, -1)
    y = torch._grouped_mm(ex.act_fn(gate) * up, ex.down_proj.transpose(-2, -1), offs=ends)
    y = y * weights.reshape(-1)[perm, None]  # as transformers: in the routing weights' dtype (fp32), one rounding
    return torch.zeros(x.shape, dtype=y.dtype, device=x.device).index_add_(0, rows, y).to(x.dtype)


FORWARDS = {"qwen3_moe": qwen3_moe_forward, "glm_moe_dsa": glm_moe_dsa_forward}
PLAIN_EXPERTS = ("Qwen3MoeExperts", "GlmMoeDsaExperts")  # transformers' stacked experts, as they ship
DENSE_MLPS = ("Qwen3MoeMLP", "GlmMoeDsaMLP")  # transformers' gated MLPs, as they ship

"""MLA decode in the latent space, for the embedded engine (GLM-5's attention with a KV cache).

transformers' MLA attention caches each token's compressed KV latent (`kv_lora_rank` dims, normed)
and rope key, and on every forward expands the whole cache through `kv_b_proj` into per-head keys
and values: a decode step then costs cached tokens x rank x heads x (nope + v) multiply-adds per
row, every step again. Here the query is taken into the latent space instead (q . W_UK c =
(W_UK^T q) . c), scores the cached latents and rope keys directly, and the weighted sum of latents
is taken back out per head (W_UV): per cached token, heads x (2 rank + rope) per query, nothing
expanded. On reverse-tiny's model a [128, 1] decode step over about 35 cached tokens took 18.4 ms
expanded and 10.9 ms here (timed by hand; `bench/engine_throughput.py`'s GLM-5 rows compare runs).

`install(model)` swaps the family spec's `attention_class` (when the spec sets `latent_decode`) for
a subclass whose forward takes this path when a cache is present and it costs less than the
expansion (`latent_is_cheaper`: always for a decode step, not for a long prefill); otherwise, and
without a cache (the trainer), transformers' forward runs. The cache, the DSA indexer's selection
and the mask are transformers' own, so both paths compute the same attention (to float rounding,
`tests/test_engine.py`). State-dict keys are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prl.model import families
from prl.model.dsa import rotate_interleaved
from prl.model.lean_forward import linear, rms_norm


def latent_is_cheaper(attn, queries: int, keys: int) -> bool:
    """Multiply-adds of one head-batched forward: expanding the cache (rank -> nope + v per key, then
    scores and the weighted sum per head) against attending in the latent space (the query into
    it and the context out of it per query, scores and the sum over rank + rope per key)."""
    H, rank, nope, rope, v = (attn.num_heads, attn.kv_lora_rank, attn.qk_nope_head_dim,
                              attn.qk_rope_head_dim, attn.v_head_dim)
    expand = keys * rank * H * (nope + v) + queries * keys * H * (nope + rope + v)
    latent = queries * H * rank * (nope + v) + queries * keys * H * (2 * rank + rope)
    return latent < expand


def absorbed_weights(attn) -> tuple[torch.Tensor, torch.Tensor]:
    """`kv_b_proj`'s two halves per head: W_UK [heads, nope, rank] (a query's no-position part into the
    latent space) and W_UV [heads, v, rank] (a weighted sum of latents back out)."""
    nope = attn.qk_nope_head_dim
    w = attn.kv_b_proj.weight.view(attn.num_heads, nope + attn.v_head_dim, attn.kv_lora_rank)
    return w[:, :nope], w[:, nope:]


def attend_latent(attn, q_pass, q_rot, latent, k_rot, mask) -> torch.Tensor:
    """[B, S, heads x v]: softmax(q . k + mask) v computed in the latent space. q_pass [B, H, S, nope],
    q_rot [B, H, S, rope] (rotated), latent [B, 1, T, rank], k_rot [B, 1, T, rope] (rotated),
    mask: [B, 1, S, T] bool (True: attend) or additive float, or None."""
    B, H, S, nope = q_pass.shape
    rank, T = attn.kv_lora_rank, latent.shape[2]
    w_uk, w_uv = absorbed_weights(attn)
    # batched products with no broadcast operand (a broadcast matmul copies its operands per batch row):
    # per head over every query for the projections, per row over all heads' queries for the scores
    q_lat = torch.bmm(q_pass.transpose(0, 1).reshape(H, B * S, nope), w_uk)  # [H, B S, rank]
    q_lat = q_lat.view(H, B, S, rank).transpose(0, 1).reshape(B, H * S, rank)
    c, r = latent[:, 0], k_rot[:, 0]  # [B, T, rank], [B, T, rope]
    scores = torch.bmm(q_lat, c.transpose(1, 2)) + torch.bmm(q_rot.reshape(B, H * S, -1), r.transpose(1, 2))
    scores = (scores * attn.scaling).view(B, H, S, T)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q_pass.dtype).view(B, H * S, T)
    ctx = torch.bmm(probs, c).view(B, H, S, rank).transpose(0, 1).reshape(H, B * S, rank)
    out = torch.bmm(ctx, w_uv.transpose(1, 2))  # [H, B S, v]
    return out.view(H, B, S, -1).permute(1, 2, 0, 3).reshape(B, S, -1)


class LatentDecodeAttention:
    """Mixin placed before transformers' GlmMoeDsaAttention (see the module docstring)."""

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                position_ids=None, prev_topk_indices=None, **kwargs):
        B, S = hidden_states.shape[:2]
        cached = 0 if past_key_values is None else past_key_values.get_seq_length(self.layer_idx)
        if past_key_values is None or not latent_is_cheaper(self, S, cached + S):
            return super().forward(hidden_states, position_embeddings, attention_mask, past_key_values,
                                   position_ids, prev_topk_indices, **kwargs)
        q_resid = rms_norm(self.q_a_layernorm, linear(self.q_a_proj, hidden_states))
        q_states = linear(self.q_b_proj, q_resid).view(B, S, -1, self.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv = linear(self.kv_a_proj_with_mqa, hidden_states)
        kv_pass, k_rot = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = rms_norm(self.kv_a_layernorm, kv_pass).view(B, 1, S, self.kv_lora_rank)
        cos, sin = position_embeddings
        q_rot = rotate_interleaved(q_rot, cos, sin, 1)
        k_rot = rotate_interleaved(k_rot.view(B, 1, S, self.qk_rope_head_dim), cos, sin, 1)
        latent, k_rot = past_key_values.update(latent, k_rot, self.layer_idx)
        if self.indexer is not None:
            topk = self.indexer(hidden_states, q_resid, position_embeddings, attention_mask[:, 0, :, :], position_ids,
                                past_key_values=past_key_values)
        elif prev_topk_indices is not None:
            topk = prev_topk_indices
        else:
            raise ValueError("shared DSA layers need the top-k indices of a previous full indexer layer")
        outside = torch.ones((B, S, latent.shape[2]), dtype=torch.bool, device=latent.device)
        outside = outside.scatter(-1, topk.long(), False).unsqueeze(1)  # keys not picked by the indexer
        if attention_mask is None:
            mask = ~outside
        elif attention_mask.dtype == torch.bool:
            mask = attention_mask & ~outside
        else:
            mask = attention_mask.masked_fill(outside, torch.finfo(attention_mask.dtype).min)
        out = attend_latent(self, q_pass, q_rot, latent, k_rot, mask)
        return linear(self.o_proj, out), None, topk


def install(model) -> int:
    """Swap the family's MLA attention for `LatentDecodeAttention` (engine models only); returns how
    many modules were swapped (0: the family has no latent decode, or none of its modules)."""
    fam = families.FAMILIES.get(getattr(model.config, "model_type", None))
    if fam is None or not fam.latent_decode:
        return 0
    mods = families.modules_of(model, fam.attention_class)
    for m in mods:
        if not isinstance(m, LatentDecodeAttention):  # installing twice is a no-op
            m.__class__ = type(f"LatentDecode{type(m).__name__}", (LatentDecodeAttention, type(m)), {})
    return len(mods)

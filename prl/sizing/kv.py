"""KV cache bytes per token, and where they live under each serving layout.

GLM-5 (MLA + DSA) stores per token and layer one compressed latent (kv_lora_rank), one rope key
(qk_rope_head_dim) and one DSA indexer key (index_head_dim), shared by every attention head. In bf16
that is (512 + 64 + 128) x 2 = 1408 bytes. In FP8 it is vLLM's DeepSeek-V3.2 layout: the latent in
E4M3 with one fp32 scale per 128 values (512 + 16), the rope key kept in bf16 (128), the indexer key in
E4M3 with one fp32 scale (128 + 4): 788 bytes. GQA models store K and V per KV head (FP8: one byte a
value). Because MLA's latent is shared by all heads, tensor parallelism cannot split it: every GPU of
a TP group holds every sequence's whole latent (`replicated`). GQA's KV heads split over TP.
"""

from __future__ import annotations

FP8_BLOCK = 128  # values per fp32 scale


def is_dsa(c: dict) -> bool:
    return c.get("model_type") == "glm_moe_dsa"


def latent_bytes(c: dict, fp8: bool) -> float:
    """One token's attention KV in one layer, the indexer key excluded."""
    if is_dsa(c):
        lora, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
        return lora + lora / FP8_BLOCK * 4 + rope * 2 if fp8 else (lora + rope) * 2
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_key_value_heads"] * hd * (1 if fp8 else 2)


def indexer_bytes(c: dict, fp8: bool) -> float:
    """One token's DSA indexer key in one layer that has an indexer (0 without DSA)."""
    if not is_dsa(c):
        return 0.0
    return c["index_head_dim"] + 4 if fp8 else c["index_head_dim"] * 2


def indexer_layers(c: dict) -> int:
    """Layers that score keys with their own indexer (shared-indexer layers reuse another's top-k)."""
    if not is_dsa(c):
        return 0
    return sum(1 for t in c.get("indexer_types") or ["full"] * c["num_hidden_layers"] if t == "full")


def kv_bytes_per_token(c: dict, fp8: bool = False) -> float:
    """Every layer's KV for one token."""
    return latent_bytes(c, fp8) * c["num_hidden_layers"] + indexer_bytes(c, fp8) * indexer_layers(c)


def replicated(c: dict) -> bool:
    """Whether a TP group holds every sequence's KV on each of its GPUs (MLA: one latent for all heads)."""
    return is_dsa(c)


def kv_share(c: dict, tp: int) -> float:
    """The fraction of a sequence's KV one GPU of a TP group holds."""
    if replicated(c):
        return 1.0
    return 1.0 / min(tp, c["num_key_value_heads"])


def sequences_that_fit(free_bytes: float, c: dict, fp8: bool, context: float, tp: int) -> float:
    """Sequences of `context` tokens whose KV fits `free_bytes` on each GPU of a TP group."""
    per_sequence = kv_bytes_per_token(c, fp8) * context * kv_share(c, tp)
    return max(free_bytes, 0.0) / per_sequence

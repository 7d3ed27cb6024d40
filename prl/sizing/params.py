"""Parameter counts of the MoE families prl trains, from a config.json dict (no torch, no transformers).

Counted per tensor as transformers 5 builds the models (`glm_moe_dsa`: MLA attention with the DSA
indexer, sigmoid router with its score-correction bias, one shared expert; `qwen3_moe`: GQA with
q/k norms, softmax router). The totals equal `sum(numel)` over the model's parameters and persistent
buffers (kept apart: they have no gradients or optimizer state) (tests/test_sizing.py checks it on built models). `Counts` splits them the way sharding
does: routed experts (split over `ep`) and everything else (split by FSDP over all ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from prl.model.families import routed_experts


@dataclass
class Counts:
    embed: int  # input embeddings
    head: int  # output head (0 when tied)
    layers: list[int]  # per decoder layer, routed experts excluded
    experts: list[int]  # per decoder layer: routed experts (0 for dense layers)
    expert_size: int  # one routed expert's parameters
    top_k: int
    final_norm: int
    buffers: int = 0  # persistent buffers (GLM-5's router score-correction bias): weights, no grads or Adam

    @property
    def dense(self) -> int:
        """Everything that is not a routed expert."""
        return self.embed + self.head + sum(self.layers) + self.final_norm

    @property
    def routed(self) -> int:
        return sum(self.experts)

    @property
    def total(self) -> int:
        """What a checkpoint holds: parameters and persistent buffers."""
        return self.dense + self.routed + self.buffers

    @property
    def active(self) -> int:
        """Parameters one token uses: all but the routed experts it was not sent to."""
        moe_layers = sum(1 for e in self.experts if e)
        return self.dense - self.embed + moe_layers * self.top_k * self.expert_size

    @property
    def largest_layer(self) -> int:
        return max(self.layers)


def count(config: dict) -> Counts:
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"prl plan: no parameter model for model_type {family!r} (known: {sorted(FAMILIES)})")
    return FAMILIES[family](config)


def linear(n_in: int, n_out: int, bias: bool = False) -> int:
    return n_in * n_out + (n_out if bias else 0)


def mlp(hidden: int, inter: int) -> int:
    return 3 * hidden * inter  # gate, up, down


def glm_moe_dsa(c: dict) -> Counts:
    h, heads, bias = c["hidden_size"], c["num_attention_heads"], c.get("attention_bias", False)
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attn = (linear(h, c["q_lora_rank"], bias) + c["q_lora_rank"] + linear(c["q_lora_rank"], heads * qk)
            + linear(h, c["kv_lora_rank"] + c["qk_rope_head_dim"], bias) + c["kv_lora_rank"]
            + linear(c["kv_lora_rank"], heads * (c["qk_nope_head_dim"] + c["v_head_dim"]))
            + linear(heads * c["v_head_dim"], h, bias))
    idx_dim = c["index_head_dim"]
    indexer = linear(c["q_lora_rank"], c["index_n_heads"] * idx_dim) + linear(h, idx_dim) + 2 * idx_dim + linear(h, c["index_n_heads"])
    E, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    kinds = c.get("mlp_layer_types") or ["dense"] * c.get("first_k_dense_replace", 0) + \
        ["sparse"] * (c["num_hidden_layers"] - c.get("first_k_dense_replace", 0))
    indexers = c.get("indexer_types") or ["full"] * c["num_hidden_layers"]
    layers, experts = [], []
    for kind, idx in zip(kinds, indexers):
        base = attn + (indexer if idx == "full" else 0) + 2 * h
        if kind == "sparse":
            layers.append(base + E * h + mlp(h, inter * c.get("n_shared_experts", 1)))  # router, shared expert
            experts.append(E * mlp(h, inter))
        else:
            layers.append(base + mlp(h, c["intermediate_size"]))
            experts.append(0)
    counts = outer(c, layers, experts, mlp(h, inter))
    counts.buffers = E * kinds.count("sparse")  # the router's e_score_correction_bias
    return counts


def qwen3_moe(c: dict) -> Counts:
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // heads
    bias = c.get("attention_bias", False)
    attn = linear(h, heads * hd, bias) + 2 * linear(h, kv * hd, bias) + linear(heads * hd, h) + 2 * hd
    E = routed_experts(c) or 0
    inter, step = c["moe_intermediate_size"], c.get("decoder_sparse_step", 1)
    dense_only = set(c.get("mlp_only_layers") or [])
    layers, experts = [], []
    for i in range(c["num_hidden_layers"]):
        sparse = i not in dense_only and E > 0 and (i + 1) % step == 0
        layers.append(attn + 2 * h + (E * h if sparse else mlp(h, c["intermediate_size"])))
        experts.append(E * mlp(h, inter) if sparse else 0)
    return outer(c, layers, experts, mlp(h, inter))


def outer(c: dict, layers: list[int], experts: list[int], expert_size: int) -> Counts:
    h, vocab = c["hidden_size"], c["vocab_size"]
    return Counts(embed=vocab * h, head=0 if c.get("tie_word_embeddings") else vocab * h, layers=layers,
                  experts=experts, expert_size=expert_size, top_k=c["num_experts_per_tok"], final_norm=h)


FAMILIES = {"glm_moe_dsa": glm_moe_dsa, "qwen3_moe": qwen3_moe}

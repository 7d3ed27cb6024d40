"""Model families prl knows, by transformers `model_type`: one spec each (torch-free, for recipe checks).

A spec is the only place that names a family's Hugging Face classes. Each feature that adapts the
model in place (routing replay, context-parallel attention, the stable DSA indexer, expert
parallelism, FP8, sharded loading) finds its modules through the spec, and a feature asked of a
family without a spec, or of a spec without that part, fails naming the family and what is known.
Classes are matched on the module's MRO, so a module prl already swapped (say FP8 experts, then
EP) is still found.

Adding a family: one `FamilySpec` below (and a tiny config in `prl.model.tiny` for `tiny`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# transformers 5 keeps a layer's routed experts stacked ([E, ...], expert e at row e of dim 0);
# checkpoints hold them per expert: stacked name -> the per-expert tensors it is stacked from, in order
STACKED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# the attention/MLP linears block-FP8 may swap (by module leaf name), where both dims are multiples of 128
FP8_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_proj", "k_proj", "v_proj",
               "gate_proj", "up_proj", "down_proj")
# sibling linears that serving engines fuse into one GEMM (vLLM: qkv_proj, gate_up_proj, fused_qkv_a_proj),
# whose FP8 scales then sit in one tensor: a group is FP8 only when every member present is eligible
FP8_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"))
# LoRA target groups (`trainer.lora.targets`): group -> module paths inside a decoder layer
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LORA_QWEN3_MOE = {"attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
                  "mlp": DENSE_MLP, "shared_experts": ()}  # Qwen3-MoE has no shared expert
# MLA: kv_b_proj is left out (the engine's latent decode absorbs it into the query and output); the DSA
# indexer's projections are not targets
LORA_MLA = {"attention": ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.q_proj",
                          "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj"),
            "mlp": DENSE_MLP,
            "shared_experts": tuple(p.replace("mlp.", "mlp.shared_experts.") for p in DENSE_MLP)}
LORA_DEFAULT = ("attention", "mlp", "shared_experts")  # routed experts dominate the count: opt-in


@dataclass(frozen=True, eq=False)
class FamilySpec:
    """What prl adapts in one transformers model family. A `None` part: the feature is not built
    for the family (its users fail loudly)."""

    model_type: str
    router_class: str | None  # R3: routing capture (engine) and replay (trainer), `prl.model.routing`
    router_scores: str | None  # how replay recomputes gating weights at given ids: "sigmoid" | "softmax"
    expert_classes: tuple[str, ...]  # stacked routed experts: expert parallelism, FP8 expert GEMMs
    attention_class: str | None = None  # the context-parallel adapter's target, `prl.trainer.context_parallel`
    indexer_class: str | None = None  # the DSA indexer (sparse attention), swapped for the stable top-k
    latent_decode: bool = False  # attention_class is MLA: the engine decodes in its latent space, `prl.model.mla`
    lean_forward: bool = False  # the engine's and trainer's forwards skip transformers' per-call machinery, `prl.model.lean_forward`
    # the Hugging Face name map prl applies itself (sharded loading: stacked experts from per-expert
    # tensors); publishing in checkpoint names uses transformers' own reverse conversion
    stacked_experts: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(STACKED_EXPERTS))
    expert_dim: int = 0  # the dim of a stacked expert tensor that counts experts (EP shards it)
    fp8_linears: tuple[str, ...] = FP8_LINEARS
    fp8_skip: tuple[str, ...] = (".indexer",)  # module paths holding these stay high precision
    fp8_fused: tuple[tuple[str, ...], ...] = FP8_FUSED  # leaf names quantised together or not at all
    tp_plan: dict[str, str] | None = None  # tensor parallelism: module pattern -> style (not built yet)
    tiny: bool = False  # `prl.model.tiny` builds a random-init model of it (`model.arch`)
    # LoRA target groups (`prl.model.lora`): group -> module paths inside a decoder layer (routed experts: not
    # built; `trainer.lora.targets` refuses them by name)
    lora_groups: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def r3(self) -> bool:
        return self.router_class is not None

    @property
    def cp(self) -> bool:
        return self.attention_class is not None

    @property
    def sparse_attention(self) -> bool:
        return self.indexer_class is not None


FAMILIES = {s.model_type: s for s in (
    FamilySpec("glm_moe_dsa", "GlmMoeDsaTopkRouter", "sigmoid", ("GlmMoeDsaExperts",),
               attention_class="GlmMoeDsaAttention", indexer_class="GlmMoeDsaIndexer", latent_decode=True,
               lean_forward=True, tiny=True, lora_groups=LORA_MLA),
    FamilySpec("deepseek_v3", "DeepseekV3TopkRouter", "sigmoid", ("DeepseekV3NaiveMoe", "DeepseekV3Experts"),
               lora_groups=LORA_MLA),
    FamilySpec("qwen3_moe", "Qwen3MoeTopKRouter", "softmax", ("Qwen3MoeExperts",), lean_forward=True, tiny=True,
               lora_groups=LORA_QWEN3_MOE),
)}


def with_feature(feature: str) -> list[str]:
    """Model types whose spec has `feature` ("r3", "cp", "sparse_attention", "tiny"), sorted."""
    return sorted(t for t, s in FAMILIES.items() if getattr(s, feature))


def spec(model_type: str, feature: str) -> FamilySpec:
    """The family's spec; `feature` (what needs it, for the message) fails on an unknown family."""
    if model_type not in FAMILIES:
        raise NotImplementedError(f"{feature}: prl has no spec for model_type {model_type!r}; known: {sorted(FAMILIES)} "
                                  f"(add one in prl.model.families)")
    return FAMILIES[model_type]


def modules_of(model, class_names: tuple[str, ...] | str | None) -> list:
    """The model's modules whose class, or a class it derives from, is named in `class_names`, in
    module order (prl's swapped subclasses still match)."""
    names = {class_names} if isinstance(class_names, str) else set(class_names or ())
    return [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]


def routed_experts(config: dict) -> int | None:
    """Routed experts per MoE layer of a config.json dict (each family names the key its own way;
    transformers 5 writes Qwen3-MoE's as num_local_experts)."""
    return next((config[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if config.get(k)), None)


def linear_patterns(spec: FamilySpec, groups: list[str]) -> list[re.Pattern]:
    """What the linear targets of `groups` are called, as module names inside a decoder layer."""
    return [re.compile(rf"(^|\.)layers\.\d+\.{re.escape(p)}$") for g in groups for p in spec.lora_groups.get(g, ())]


def folder_has_targets(model_type: str, names: list[str], experts: int | None, groups: list[str]) -> bool:
    """Whether a pretrained folder (its tensors' names, its config's routed experts) holds some module of
    `groups` (`target_modules` on the model the trainer builds from it); True for a family prl does not adapt
    (the trainer names the problem then)."""
    spec = FAMILIES.get(model_type)
    if spec is None:
        return True
    if "routed_experts" in groups and experts:
        return True
    patterns = linear_patterns(spec, groups)
    return any(p.search(n.rsplit(".", 1)[0]) for n in names for p in patterns)

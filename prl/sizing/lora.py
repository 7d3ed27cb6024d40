"""LoRA in the plan (`trainer.lora`): adapters on a frozen base, counted from the model's config.json.

Adapters. A target linear `[out, in]` gains A `[r, in]` and B `[out, r]`: r x (in + out) parameters; a
stacked routed-expert weight `[E, out, in]` gains A `[E, r, in]` and B `[E, out, r]`. The targets of a
group are those `prl.model.families` names: "attention" (MLA: q_a_proj, q_b_proj (q_proj without a q
LoRA), kv_a_proj_with_mqa, o_proj; kv_b_proj and the DSA indexer are not targets; GQA: q, k, v, o),
"mlp" (the dense layers' gate, up, down), "shared_experts" (their gate, up, down), "routed_experts"
(each layer's stacked gate_up_proj `[E, 2I, h]` and down_proj `[E, h, I]`).

Memory of a trainer GPU: the frozen base at trainer.dtype, or block FP8 (1 byte + an fp32 scale per
128 x 128 block) for the weights whose GEMMs trainer.fp8 runs in FP8, sharded as in full fine-tuning
(routed experts over ep, the rest by FSDP over all ranks); the adapters in fp32 with their gradients
and Adam's two moments (16 B a parameter), routed experts' over ep, the rest over all ranks. No
gradient or optimizer state for the base; activations as in full fine-tuning; no KL reference copy
(the reference is the base with its adapters off). As built today the trainer keeps the frozen base
at trainer.dtype, not yet in FP8: `as_built` counts that.

Compute. A frozen weight's backward still computes the gradient of its input (every layer's, down to
the first adapter) but not its own. Per parameter and token: forward 2 FLOPs, input gradient 2,
weight gradient 2 in full fine-tuning and 0 for a frozen weight, recomputed forward 2 with activation
checkpointing. So the base's GEMMs cost (passes - 1) / passes of full fine-tuning's: 6/8 with
checkpointing, 4/6 = 2/3 without; the adapters train in full (bf16 GEMMs, 2 x their active parameters
x tokens x passes). Attention, the indexer, the expert all-to-all and CP exchanges are unchanged (the
input gradients cross them). FSDP: the base is gathered as before, but no gradients are reduce-scattered
but the adapters'. Computed, not measured.

Weight update. After v0 a version holds the adapters alone, fp32 on the wire (as the trainer
publishes them today): r x (in + out) x 4 bytes a target, every inference host receiving all of
them (routed experts' adapters: its experts' only). Each GPU merges its copy in place, taking out the
previous adapter and adding the new one (W += B'A - B'_old A_old: 4 r in out FLOPs a target, the target
weights read and written once); the first version (v0) is the whole model, as in full fine-tuning.
"""

from __future__ import annotations

from prl.model.families import routed_experts
from prl.recipe.schema import LoraCfg, Recipe
from prl.sizing import kv
from prl.sizing.params import Counts

GB = 1e9
WIRE_BYTES = 4  # adapters are published in fp32


def target_shapes(c: dict, n: Counts) -> dict[str, list[tuple[int, int, int]]]:
    """Group -> (weights of that shape in the model, in, out) for each target; routed experts counted per
    expert (its slice of the stacked weight)."""
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    sparse = sum(1 for e in n.experts if e)
    dense, inter = layers - sparse, c["moe_intermediate_size"]
    if kv.is_dsa(c):
        heads, qk, q = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c.get("q_lora_rank")
        query = [(layers, h, q), (layers, q, heads * qk)] if q else [(layers, h, heads * qk)]
        attn = query + [(layers, h, c["kv_lora_rank"] + c["qk_rope_head_dim"]),
                        (layers, heads * c["v_head_dim"], h)]
        shared = inter * c.get("n_shared_experts", 1)
    else:
        hd = c.get("head_dim") or h // c["num_attention_heads"]
        q, kvd = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
        attn, shared = [(layers, h, q), (layers, h, kvd), (layers, h, kvd), (layers, q, h)], 0

    def mlp(count: int, i: int) -> list[tuple[int, int, int]]:
        return [(count, h, i), (count, h, i), (count, i, h)] if count and i else []

    experts = sparse * (routed_experts(c) or 0)
    return {"attention": attn, "mlp": mlp(dense, c.get("intermediate_size", 0)), "shared_experts": mlp(sparse, shared),
            "routed_experts": [(experts, h, 2 * inter), (experts, inter, h)] if experts else []}


def adapters(c: dict, n: Counts, lora: LoraCfg) -> tuple[int, int]:
    """(adapter parameters on everything but the routed experts, on the routed experts)."""
    shapes = target_shapes(c, n)
    count = {g: sum(k * lora.rank * (i + o) for k, i, o in shapes[g]) for g in lora.targets}
    routed = count.pop("routed_experts", 0)
    return sum(count.values()), routed


def adapted(c: dict, n: Counts, lora: LoraCfg) -> tuple[int, int]:
    """(base parameters under an adapter but the routed experts, routed-expert parameters under one)."""
    shapes = target_shapes(c, n)
    count = {g: sum(k * i * o for k, i, o in shapes[g]) for g in lora.targets}
    routed = count.pop("routed_experts", 0)
    return sum(count.values()), routed


def active_adapters(c: dict, n: Counts, lora: LoraCfg) -> float:
    """Adapter parameters one token uses: all but the routed experts' it was not sent to."""
    dense, routed = adapters(c, n, lora)
    return dense + routed * n.top_k / (routed_experts(c) or 1)


def base_bytes(recipe: Recipe, n: Counts, fp8_dense: float, as_built: bool = False) -> tuple[float, float]:
    """(bytes of one frozen routed-expert parameter, bytes of the rest of the frozen base): FP8 + block
    scales where trainer.fp8 runs the GEMM in FP8 (`fp8_dense`: such parameters outside the routed
    experts), else trainer.dtype; trainer.dtype throughout `as_built` (what the trainer holds today: FP8 base
    planned)."""
    t = recipe.trainer
    cb = 4 if t.dtype == "float32" else 2
    if t.fp8 and not as_built:
        f8 = 1 + 4 / kv.FP8_BLOCK ** 2
        return f8, fp8_dense * f8 + (n.dense - fp8_dense) * cb
    return cb, n.dense * cb


def weight_memory(recipe: Recipe, c: dict, n: Counts, world: int, fp8_dense: float,
                  as_built: bool = False) -> dict[str, float]:
    """The weight items of a trainer GPU's memory under LoRA (the module docstring)."""
    par, cb = recipe.trainer.parallel, 2 if recipe.trainer.dtype == "bfloat16" else 4
    expert_b, rest = base_bytes(recipe, n, fp8_dense, as_built)
    dense_a, routed_a = adapters(c, n, recipe.trainer.lora)
    kind = f"{recipe.trainer.dtype}, as built" if as_built else ("FP8 where trainer.fp8, else " if recipe.trainer.fp8 else "") + \
        recipe.trainer.dtype
    return {
        f"frozen base, routed experts ({expert_b:.2f} B/param over ep)": n.routed / par.ep * expert_b,
        f"frozen base, the rest ({kind}, over all ranks)": rest / world + n.buffers * 4,
        "LoRA adapters + grads + Adam (16 B/param; routed experts' over ep, the rest over all ranks)":
            (dense_a / world + routed_a / par.ep) * 16,
        "FSDP working set (2 layers gathered + 1 layer of adapter grads)":
            n.largest_layer * 2 * cb + dense_a / c["num_hidden_layers"] * 4,
    }


def host_update_bytes(recipe: Recipe, c: dict, n: Counts, experts_per_host: float) -> tuple[float, float]:
    """(bytes one inference host receives for an adapter version, of them wanted by every GPU of the host):
    every adapter but the routed experts', and the routed experts' of the `experts_per_host` it serves."""
    dense, routed = adapters(c, n, recipe.trainer.lora)
    share = min(1.0, experts_per_host / (routed_experts(c) or 1))
    return (dense + routed * share) * WIRE_BYTES, dense * WIRE_BYTES


def merge_seconds(recipe: Recipe, c: dict, n: Counts, tp: int, experts_per_gpu: float) -> float:
    """One GPU merging an adapter version in place (module docstring): 4 r in out FLOPs a target at
    plan.mfu of the bf16 peak, and its target weights read and written once at plan.hbm_tb_s."""
    pl, lora = recipe.plan, recipe.trainer.lora
    dense, routed = adapted(c, n, lora)
    params = dense / tp + routed * experts_per_gpu / (routed_experts(c) or 1)
    wb = 1 + 4 / kv.FP8_BLOCK ** 2 if recipe.inference.fp8 else (2 if recipe.inference.dtype == "bfloat16" else 4)
    return 4 * lora.rank * params / (pl.gpu_tflops * 1e12 * pl.mfu) + 2 * params * wb / (pl.hbm_tb_s * 1e12)


def backward_passes(recipe: Recipe, passes: int) -> int:
    """GEMM passes of a frozen base weight: full fine-tuning's less the weight gradient."""
    return passes - 1 if recipe.trainer.lora.enabled else passes


def without_lora(recipe: Recipe) -> Recipe:
    """The same recipe, every weight trained (what LoRA is compared with)."""
    return recipe.model_copy(update={"trainer": recipe.trainer.model_copy(update={"lora": LoraCfg()})})


def uses(recipe: Recipe) -> tuple[str, ...]:
    """The LoRA mechanisms a trainer term relies on."""
    lora = recipe.trainer.lora
    return ("lora_trainer",) + (("lora_routed",) if "routed_experts" in lora.targets else ())


def serving_uses(recipe: Recipe) -> tuple[str, ...]:
    """The LoRA mechanisms an adapter version's way into the servers relies on."""
    backend = ("lora_vllm",) if recipe.inference.backend == "vllm" else ()
    fp8 = ("lora_fp8_serving",) if recipe.inference.fp8 else ()
    return uses(recipe) + backend + fp8


def term_uses(recipe: Recipe, key: str) -> tuple[str, ...]:
    """The LoRA mechanisms a term of `prl plan` relies on (its key without "trainer " or "rollout ")."""
    t = recipe.trainer
    if not t.lora.enabled:
        return ()
    if key.startswith("frozen base"):
        return uses(recipe) + (("lora_base_dtype",) if t.fp8 else ())
    if key.startswith(("LoRA", "FSDP", "GEMMs")):
        return uses(recipe)
    if key.startswith("weight"):
        return serving_uses(recipe)
    return ()

"""Model families prl knows, by transformers `model_type` (torch-free, for recipe checks)."""

# family -> its router class (routing capture and replay, `prl.model.routing`)
ROUTER_CLASSES = {
    "glm_moe_dsa": "GlmMoeDsaTopkRouter",
    "deepseek_v3": "DeepseekV3TopkRouter",
    "qwen3_moe": "Qwen3MoeTopKRouter",
}


def routed_experts(config: dict) -> int | None:
    """Routed experts per MoE layer of a config.json dict (each family names the key its own way;
    transformers 5 writes Qwen3-MoE's as num_local_experts)."""
    return next((config[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if config.get(k)), None)

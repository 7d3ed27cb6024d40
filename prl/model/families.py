"""Model families prl knows, by transformers `model_type` (torch-free, for recipe checks)."""

# family -> its router class (routing capture and replay, `prl.model.routing`)
ROUTER_CLASSES = {
    "glm_moe_dsa": "GlmMoeDsaTopkRouter",
    "deepseek_v3": "DeepseekV3TopkRouter",
    "qwen3_moe": "Qwen3MoeTopKRouter",
}

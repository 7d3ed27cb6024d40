"""Build a model from a run's model folder (config.json + tokenizer) and load weights into it."""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(model_dir: str | Path, seed: int = 0, dtype: str = "float32"):
    """Random-init model from the config in `model_dir` (same seed -> same weights on every rank)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    return model


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)

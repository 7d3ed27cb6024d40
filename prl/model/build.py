"""Build a model from a run's model folder: its weights when it has them (a pretrained `model.path`,
linked in), else random init from config.json with the run's seed (the tiny models)."""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(model_dir: str | Path, seed: int = 0, dtype: str = "float32"):
    """The folder's weights, or random init (same seed -> same weights on every rank and server)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from prl.model.pretrained import has_weights, load_pretrained

    from prl.model import dsa

    if has_weights(model_dir):
        model = load_pretrained(Path(model_dir), DTYPES[dtype])
    else:
        config = AutoConfig.from_pretrained(model_dir)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    dsa.install(model)  # GLM-5: the indexer's top-k breaks ties by position, the same in engine and trainer
    return model


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)

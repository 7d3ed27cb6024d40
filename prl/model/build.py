"""Build a model from a run's model folder: its weights when it has them (a pretrained `model.path`,
linked in), else random init from config.json with the run's seed (the tiny models)."""

from __future__ import annotations

from pathlib import Path


def torch_dtype(name: str):
    """The torch dtype a recipe's dtype name stands for (torch is imported here: `prl run`'s checks load a
    tokenizer from this module, without torch)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def build_model(model_dir: str | Path, seed: int = 0, dtype: str = "float32"):
    """The folder's weights, or random init (same seed -> same weights on every rank and server)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from prl.model.pretrained import has_weights, load_pretrained

    from prl.model import dsa

    if has_weights(model_dir):
        model = load_pretrained(Path(model_dir), torch_dtype(dtype))
    else:
        config = AutoConfig.from_pretrained(model_dir)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
    dsa.install(model)  # GLM-5: the indexer's top-k breaks ties by position, the same in engine and trainer
    return model


GENERIC_TOKENIZERS = {"TokenizersBackend", "PreTrainedTokenizerFast"}  # transformers' generic fast tokenizer


def load_tokenizer(model_dir: str | Path):
    """The folder's tokenizer, as `AutoTokenizer` loads it. A folder whose tokenizer_config.json names transformers'
    generic fast tokenizer (a `tokenizer.json` alone: prl's tiny models, many exported ones) is loaded by that class
    directly: the same object, without importing the model registry `AutoTokenizer` pulls in (3-4 s of a core in
    each process that only tokenizes: the orchestrator, `prl run`'s checks)."""
    if generic_tokenizer(Path(model_dir)):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def generic_tokenizer(folder: Path) -> bool:
    """The folder's tokenizer is transformers' generic fast one (its class named, a tokenizer.json, no code)."""
    import json

    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(config, dict) and config.get("tokenizer_class") in GENERIC_TOKENIZERS
            and "auto_map" not in config and (folder / "tokenizer.json").is_file())

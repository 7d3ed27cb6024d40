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
# model types for which AutoTokenizer keeps a generic class the folder names (prl's tiny families; for some other
# types it loads a class of the type's own instead, e.g. qwen2's)
GENERIC_MODEL_TYPES = {"glm_moe_dsa", "qwen3_moe"}


def load_tokenizer(model_dir: str | Path):
    """The folder's tokenizer, as `AutoTokenizer` loads it. A folder of prl's tiny families whose tokenizer is
    transformers' generic fast one (a `tokenizer.json`) is loaded by that class directly: the same object, without
    the model registry `AutoTokenizer` imports (3-4 s of a core in each process that only tokenizes: the
    orchestrator, `prl run`'s checks)."""
    if generic_tokenizer(Path(model_dir)):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def generic_tokenizer(folder: Path) -> bool:
    """AutoTokenizer would load the folder's tokenizer as transformers' generic fast one: its tokenizer_config.json
    names that class and no code of its own, a tokenizer.json is there, and config.json (if any) is of a model type
    for which AutoTokenizer keeps the class named."""
    tokenizer = json_of(folder / "tokenizer_config.json")
    if not (isinstance(tokenizer, dict) and tokenizer.get("tokenizer_class") in GENERIC_TOKENIZERS
            and "auto_map" not in tokenizer and (folder / "tokenizer.json").is_file()):
        return False
    if not (folder / "config.json").exists():  # a tokenizer alone
        return True
    config = json_of(folder / "config.json")
    return isinstance(config, dict) and config.get("model_type") in GENERIC_MODEL_TYPES


def json_of(path: Path):
    """The file's JSON, or None where it is missing or not JSON."""
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None

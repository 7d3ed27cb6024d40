"""`prl ckpt export`: a verified checkpoint -> a Hugging Face folder that from_pretrained loads."""

from __future__ import annotations

from pathlib import Path

from prl.model.weights import CorruptWeightsError, read_weights, sealed


class ExportError(RuntimeError):
    pass


def find_checkpoint(run_dir: Path, step: str) -> Path:
    root = Path(run_dir) / "checkpoints"
    steps = sealed(root, "step_")
    if not steps:
        raise ExportError(f"{root}: no complete checkpoint")
    if step == "latest":
        return root / f"step_{steps[-1]}"
    if not step.isdigit() or int(step) not in steps:
        raise ExportError(f"{root}: no checkpoint for step {step!r}; available: {steps}")
    return root / f"step_{int(step)}"


def export(run_dir: Path, step: str, out: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from prl.model.build import load_tokenizer

    run_dir = Path(run_dir)
    model_dir = run_dir / "model"
    path = find_checkpoint(run_dir, step)
    try:
        state, _ = read_weights(path)
    except CorruptWeightsError as e:
        raise ExportError(str(e)) from None
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ExportError(f"{path}: does not match {model_dir}/config.json (missing {missing[:3]}, extra {unexpected[:3]})")
    out = Path(out)
    model.save_pretrained(out)
    load_tokenizer(model_dir).save_pretrained(out)
    return out

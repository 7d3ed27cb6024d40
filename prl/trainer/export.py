"""`prl ckpt export`: a verified checkpoint -> a Hugging Face folder that from_pretrained loads."""

from __future__ import annotations

from pathlib import Path

from prl.model.weights import WEIGHTS_PREFIX, CorruptWeightsError, sealed


class ExportError(RuntimeError):
    pass


def find_checkpoint(run_dir: Path, step: str) -> Path:
    """The checkpoint of `step` ("latest" or a number): a resumable one, else the weights-only snapshot the
    trainer writes for an eval set."""
    root = Path(run_dir) / "checkpoints"
    full, weights = sealed(root, "step_"), sealed(root, WEIGHTS_PREFIX)
    steps = sorted(set(full) | set(weights))
    if not steps:
        raise ExportError(f"{root}: no complete checkpoint")
    if step == "latest":
        step = str(steps[-1])
    if not step.isdigit() or int(step) not in steps:
        raise ExportError(f"{root}: no checkpoint for step {step!r}; available: {steps}")
    return root / (f"step_{int(step)}" if int(step) in full else f"{WEIGHTS_PREFIX}{int(step)}")


def export(run_dir: Path, step: str, out: Path, fp8: bool = False) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from prl.model.build import load_tokenizer
    from prl.model.mtp_weights import copy_draft_layers
    from prl.trainer.checkpoint import read_model_state

    run_dir = Path(run_dir)
    model_dir = run_dir / "model"
    path = find_checkpoint(run_dir, step)
    try:
        state, _ = read_model_state(path)
    except CorruptWeightsError as e:
        raise ExportError(str(e)) from None
    config = AutoConfig.from_pretrained(model_dir)
    if hasattr(config, "quantization_config"):  # the run's vLLM FP8 serving layout: not what is written here
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ExportError(f"{path}: does not match {model_dir}/config.json (missing {missing[:3]}, extra {unexpected[:3]})")
    out = Path(out)
    if fp8:
        write_fp8(model, out)
    else:
        model.save_pretrained(out)
    load_tokenizer(model_dir).save_pretrained(out)
    copy_draft_layers(model_dir, out)  # MTP layers: not trained, kept so the export still drafts
    return out


def write_fp8(model, out: Path) -> None:
    """A block-FP8 Hugging Face folder in the DeepSeek-V3 / GLM-5-FP8 layout (per-expert tensors, each
    FP8 weight with its `weight_scale_inv`), the same names and values prl publishes to vLLM."""
    from safetensors.torch import save_file

    from prl.model.fp8_checkpoint import fp8_tensor_names, serving_config, to_fp8_checkpoint

    state = to_fp8_checkpoint(model, model.state_dict(), fp8_tensor_names(model))
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = serving_config(model)
    model.config.save_pretrained(out)


def read_fp8(folder: Path) -> tuple[dict, dict]:
    """Read a block-FP8 folder back: (tensors with FP8 weights and their scales, quantization_config)."""
    import json

    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    qc = config.get("quantization_config")
    if not qc or qc.get("weight_block_size") != [128, 128]:
        raise ExportError(f"{folder}: not a block-FP8 checkpoint (quantization_config {qc})")
    return load_file(str(folder / "model.safetensors")), qc

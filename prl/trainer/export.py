"""`prl ckpt export`: a verified checkpoint -> a Hugging Face folder that from_pretrained loads; a LoRA checkpoint
(adapters alone) -> a PEFT adapter folder, or merged into its base (the run's step 0) a whole Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

from prl.model.policy import LoraPolicy, checkpoint_policy
from prl.model.weights import MANIFEST, WEIGHTS_PREFIX, CorruptWeightsError, sealed


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


def export(run_dir: Path, step: str, out: Path, fp8: bool = False, merged: bool = False) -> Path:
    """The checkpoint of `step` as a Hugging Face folder. A LoRA checkpoint (the adapters alone): a PEFT adapter
    folder, or with `merged` its base (the run's step-0 checkpoint) with the adapters merged in; `merged` on a
    checkpoint of every weight changes nothing."""
    run_dir = Path(run_dir)
    path = find_checkpoint(run_dir, step)
    state, manifest = read_checkpoint(path)
    try:
        policy = checkpoint_policy(manifest)  # what the checkpoint holds
    except ValueError as e:
        raise ExportError(f"{path}: {e}") from None
    if policy.base_checkpoint and not merged:
        if fp8:
            raise ExportError(f"{path}: --fp8 writes a whole model and this LoRA checkpoint holds adapters: add --merged")
        return export_adapter(run_dir, path, policy, policy.trained(state), Path(out))
    if policy.base_checkpoint:
        state = merged_state(path, state, policy)
    return write_hf(run_dir / "model", path, state, Path(out), fp8)


def read_checkpoint(path: Path) -> tuple[dict, dict]:
    from prl.trainer.checkpoint import read_model_state

    try:
        return read_model_state(path)
    except CorruptWeightsError as e:
        raise ExportError(str(e)) from None


def write_hf(model_dir: Path, path: Path, state: dict, out: Path, fp8: bool) -> Path:
    """Every weight of a checkpoint (in-memory names) as a Hugging Face folder of the run's model, with its
    tokenizer and MTP draft layers."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from prl.model.build import load_tokenizer
    from prl.model.mtp_weights import copy_draft_layers

    hf_logging.disable_progress_bar()  # "Writing model shards" bars: prl's commands say what they wrote
    config = AutoConfig.from_pretrained(model_dir)
    if hasattr(config, "quantization_config"):  # the run's vLLM FP8 serving layout: not what is written here
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ExportError(f"{path}: does not match {model_dir}/config.json (missing {missing[:3]}, extra {unexpected[:3]})")
    if fp8:
        write_fp8(model, out)
    else:
        model.save_pretrained(out)
    load_tokenizer(model_dir).save_pretrained(out)
    copy_draft_layers(model_dir, out)  # MTP layers: not trained, kept so the export still drafts
    return out


def merged_state(path: Path, state: dict, policy: LoraPolicy) -> dict:
    """Every weight of the LoRA checkpoint at `path` (`state`: its adapters and buffers): its base's (the
    checkpoint its manifest names, the run's step 0), each target's as `W + alpha / rank * B @ A`."""
    base_path = path.parent / policy.base_checkpoint
    if not (base_path / MANIFEST).is_file():
        raise ExportError(f"{path} holds LoRA adapters alone and its base {base_path} (the run's step-0 "
                          f"checkpoint) is missing: the merged model cannot be written")
    base, manifest = read_checkpoint(base_path)
    try:
        if manifest.get("lora"):
            raise ValueError("it holds adapters too")
        return policy.merged_state(state, base)
    except ValueError as e:
        raise ExportError(f"{base_path} is not the base of the adapters in {path}: {e}") from None


def export_adapter(run_dir: Path, path: Path, policy: LoraPolicy, adapter: dict, out: Path) -> Path:
    """A LoRA checkpoint's adapters as a PEFT folder, named by Hugging Face checkpoint module paths."""
    import torch

    from prl.model.hf_format import checkpoint_name, meta_model_of
    from prl.model.lora import check_adapter, target_of
    from prl.model.peft_adapter import AdapterError, adapter_config, peft_targets, write_adapter

    skeleton = meta_model_of(run_dir / "model")
    problems = check_adapter(adapter, {k: tuple(v.shape) for k, v in skeleton.state_dict().items()})
    if problems:
        raise ExportError(f"{path}: does not match {run_dir / 'model'}/config.json: {'; '.join(problems[:3])}")
    stacked = sorted({target_of(k) for k in adapter if not target_of(k).endswith(".weight")})
    if stacked:
        raise ExportError(f"{path}: adapters on the stacked routed experts ({stacked[0]}, ...) have no PEFT layout; "
                          f"export the merged model with --merged")
    tensors = {}
    for name, t in adapter.items():
        target = target_of(name)
        stem = checkpoint_name(skeleton, target).removesuffix(".weight")
        tensors[stem + name[len(target) - len(".weight"):]] = t
    adapted = {target_of(k).removesuffix(".weight") for k in adapter}
    linears = [n for n, m in skeleton.named_modules() if isinstance(m, torch.nn.Linear)]
    try:
        targets = peft_targets(adapted, linears)
    except AdapterError as e:
        raise ExportError(f"{path}: {e}") from None
    return write_adapter(out, tensors, adapter_config(policy.cfg.rank, policy.cfg.alpha, lora_dropout(run_dir), targets))


def lora_dropout(run_dir: Path) -> float:
    """The run's `trainer.lora.dropout` (PEFT's config records it; it changes no weight)."""
    import json

    try:
        return float(json.loads((run_dir / "recipe.json").read_text())["trainer"]["lora"]["dropout"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


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

"""MTP draft layers: the multi-token-prediction layers a DeepSeek-style checkpoint keeps after its
decoder layers (`model.layers.{L}` .. `model.layers.{L + num_nextn_predict_layers - 1}` for a model of
L layers). vLLM serves them as the speculative drafter (`inference.mtp_tokens`).

Rules:
- the trainer does not train them: transformers' model has no place for them, so both loaders
  (whole and sharded) set their tensors aside by name, and nothing else unexpected is let through;
- the servers' drafter keeps the folder's draft weights while the target model's weights change
  every step (acceptance may fall as the policy drifts; the plan's `mtp_acceptance` is an assumption);
- `prl ckpt export` copies them from the run's model folder unchanged, so an exported checkpoint
  still serves with MTP.

This module names them (torch-free); `prl.model.mtp_weights` reads and writes their tensors.
"""

from __future__ import annotations

import re

MTP_FAMILIES = ("glm_moe_dsa", "deepseek_v3", "deepseek_v32")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def draft_layers(config: dict) -> range:
    """Indices of the config's MTP layers (empty for families without them)."""
    if config.get("model_type") not in MTP_FAMILIES:
        return range(0)
    n, d = int(config.get("num_hidden_layers", 0)), int(config.get("num_nextn_predict_layers") or 0)
    return range(n, n + d)


def is_draft(name: str, layers: range) -> bool:
    m = LAYER.match(name)
    return bool(m) and int(m.group(1)) in layers


def draft_names(names, config: dict) -> set[str]:
    """The tensor names among `names` that belong to the config's MTP layers."""
    layers = draft_layers(config)
    return {n for n in names if is_draft(n, layers)} if layers else set()


def missing_draft_layers(names, config: dict) -> list[int]:
    """MTP layers the config declares whose tensors the folder lacks (vLLM would refuse to draft)."""
    present = {int(LAYER.match(n).group(1)) for n in draft_names(names, config)}
    return [i for i in draft_layers(config) if i not in present]


# the MTP layer's own modules (besides its decoder block): kept in high precision when serving FP8
OWN_MODULES = ("enorm", "hnorm", "eh_proj", "shared_head", "shared_head.head", "shared_head.norm", "embed_tokens")


def draft_kept_modules(kept: list[str], config: dict) -> list[str]:
    """`modules_to_not_convert` for the draft layers under FP8 serving: the modules of the last decoder
    layer that stay high precision, at each draft layer's index, plus the layer's own modules (its
    block's FP8 linears are then FP8 exactly like the last layer's)."""
    layers = draft_layers(config)
    if not layers:
        return []
    last = f"model.layers.{layers.start - 1}."
    out = []
    for d in layers:
        out += [f"model.layers.{d}." + m[len(last):] for m in kept if m.startswith(last)]
        out += [f"model.layers.{d}.{m}" for m in OWN_MODULES]
    return out

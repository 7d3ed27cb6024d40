"""What a run trains, and what its checkpoints and weight versions hold: one object that the trainer, the
publisher, export and the servers ask, so no `if lora` is spread among them.

- `FullPolicy`: every weight trains; every checkpoint and every version holds every weight.
- `LoraPolicy` (`trainer.lora`, the mechanics in `prl.model.lora`): low-rank adapters on a frozen base held at
  `trainer.dtype`. The warm start trains every weight; the step-0 checkpoint is then the base (no optimizer)
  and the model is built again on it with adapters. Version 0 is the base, whole; every later version holds
  the adapters alone, B scaled (`Version`, its manifest naming the base), and every later checkpoint the
  adapters and their optimizer (its manifest's `lora` block). The KL reference is the same model, adapters off.

The trainer takes its policy from the recipe (`policy_for`), export from a checkpoint's manifest
(`checkpoint_policy`); a server learns what a received version is, and how to apply it, from the version's
manifest (`Version.of`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from prl.model.lora import (adapters_off, apply_lora, check_adapter, freeze_base, init_adapters,
                            is_adapter, merged, published_adapters, target_of, wire_state)
from prl.model.weights import nonfinite_names
from prl.recipe.schema import LoraCfg

BASE_VERSION = 0  # under LoRA: the published version the adapters apply to (whole; never pruned)
BASE_CHECKPOINT = "step_0"  # under LoRA: the checkpoint that holds the frozen base


@dataclass(frozen=True)
class Version:
    """What one published weight version holds: every weight (`base` None), or LoRA adapters alone (`X.lora_A`,
    `X.lora_B` with the scale folded into B) that apply to the whole version `base`. `scale` is the trainer's
    (alpha / rank): a server never needs it."""

    base: int | None = None
    rank: int = 0
    scale: float = 1.0

    @classmethod
    def of(cls, manifest: dict) -> Version:
        """A received version's, from its manifest (ValueError: an adapter version naming no base)."""
        adapter = manifest.get("adapter")
        if not adapter:
            return WHOLE
        try:
            return cls(base=int(adapter["base"]), rank=int(adapter.get("rank", 0)))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"its manifest's adapter block {adapter!r} names no base version") from None

    @property
    def adapters(self) -> bool:
        return self.base is not None

    def holds(self, name: str) -> bool:
        """Whether the version carries the model's tensor `name` (an adapter version the adapters alone; a whole
        version of a model with adapters every weight but them)."""
        return is_adapter(name) == self.adapters

    def manifest(self, meta: dict) -> dict:
        return {**meta, "adapter": {"base": self.base, "rank": self.rank}} if self.adapters else meta

    def wire(self, model, part: dict[str, torch.Tensor], hf_format: bool) -> dict[str, torch.Tensor]:
        """A bucket of adapters as published (B scaled; named after their target's checkpoint name where
        `hf_format`)."""
        return published_adapters(model, part, hf_format, self.scale)

    # ---- a server's side: an adapter version as received
    def refusal(self, raw: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> list[str]:
        """Why the adapters `raw` cannot apply to a model of these tensor shapes (empty: they can): every target
        known, A and B paired and fitting, finite values."""
        problems = check_adapter(raw, shapes) if raw else ["no adapter tensors"]
        nonfinite = nonfinite_names(raw)
        return problems or ([f"non-finite {nonfinite[:5]}"] if nonfinite else [])

    def targets(self, raw: dict[str, torch.Tensor]) -> set[str]:
        """The model's weights the adapters change."""
        return {target_of(k) for k in raw}

    def merge(self, raw: dict[str, torch.Tensor], source) -> dict[str, torch.Tensor]:
        """The target weights the adapters make, `W_base + B' @ A`, from the base version's targets in `source`
        (a `prl.model.lora.AdapterBase`)."""
        return merged(source.targets(self.base, self.targets(raw)), raw)


WHOLE = Version()


@dataclass
class Reference:
    """The frozen reference policy of trainer.loss.kl_coef: a model, and what its forward runs within."""

    model: torch.nn.Module
    within: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


class FullPolicy:
    """Every weight trains; every checkpoint and every weight version holds every weight."""

    on_base = False  # whether the RL model is the step-0 checkpoint with something built on it, built again
    resume_after = -1  # a run resumes from a checkpoint after this step
    base_checkpoint: str | None = None  # the checkpoint holding what a later one leaves out (None: nothing)

    def adapt(self, model, dtype: str, seed: int) -> None:
        """The model as trained, before it is parallelized."""

    def after_load(self, model, seed: int) -> None:
        """After a sharded read of a pretrained folder (which holds no trained additions)."""

    def reference(self, model) -> Reference | None:
        """The KL reference if the policy's own model serves as one (None: a separate frozen model)."""
        return None

    def checkpoint_optimizer(self, step: int) -> bool:
        """Whether the checkpoint of `step` holds the optimizer."""
        return True

    def checkpoint_manifest(self, step: int) -> dict | None:
        """More manifest fields of the checkpoint of `step`."""
        return None

    def version(self, version: int) -> Version:
        return WHOLE

    def trained(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What of a checkpoint's state the run trained."""
        return state


@dataclass
class LoraPolicy(FullPolicy):
    """Adapters on a frozen base (the module docstring)."""

    cfg: LoraCfg
    base_checkpoint: str | None = field(default=BASE_CHECKPOINT)
    on_base = True
    resume_after = 0  # step 0 is the base: no adapters, no optimizer

    @classmethod
    def from_manifest(cls, lora: dict) -> LoraPolicy:
        """A checkpoint's, from its manifest's `lora` block (`LoraCfg.manifest`; ValueError where damaged)."""
        try:
            cfg = LoraCfg(rank=lora["rank"], alpha=lora["alpha"], targets=lora["targets"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"its manifest's lora block lacks {e}") from None
        return cls(cfg, str(lora.get("base", BASE_CHECKPOINT)))

    def adapt(self, model, dtype: str, seed: int) -> None:
        c = self.cfg
        apply_lora(model, model.config.model_type, c.rank, c.alpha, c.dropout, c.targets, seed=seed)
        freeze_base(model, dtype)

    def after_load(self, model, seed: int) -> None:
        init_adapters(model, seed)  # the adapters are in no folder: drawn again into this rank's shards

    def reference(self, model) -> Reference:
        return Reference(model, lambda: adapters_off(model))

    def checkpoint_optimizer(self, step: int) -> bool:
        return step > 0

    def checkpoint_manifest(self, step: int) -> dict | None:
        return {"lora": self.cfg.manifest()} if step > 0 else None

    def version(self, version: int) -> Version:
        return Version(BASE_VERSION, self.cfg.rank, self.cfg.scale) if version > BASE_VERSION else WHOLE

    def trained(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in state.items() if is_adapter(k)}

    def merged_state(self, state: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every weight of a checkpoint (`state`: its adapters and buffers) over its base's: each target
        `W + alpha / rank * B @ A`, buffers (a router's bias) the checkpoint's own (ValueError: the adapters do
        not fit `base`)."""
        adapter = self.trained(state)
        problems = check_adapter(adapter, {k: tuple(v.shape) for k, v in base.items()})
        if problems:
            raise ValueError("; ".join(problems[:3]))
        buffers = {k: v for k, v in state.items() if k not in adapter}
        return {**base, **buffers, **merged(base, wire_state(adapter, self.cfg.scale))}


FULL = FullPolicy()


def policy_for(lora: LoraCfg) -> FullPolicy:
    """The run's policy, from `trainer.lora`."""
    return LoraPolicy(lora) if lora.enabled else FULL


def checkpoint_policy(manifest: dict) -> FullPolicy:
    """The policy a checkpoint was written under, from its manifest (ValueError: a damaged `lora` block)."""
    lora = manifest.get("lora")
    return LoraPolicy.from_manifest(lora) if lora else FULL


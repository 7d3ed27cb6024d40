"""Rollout routing replay (R3): capture the experts the engine chose, replay them in the trainer.

Each family's spec (`prl.model.families`) names its router class and how its gating weights are
recomputed at given expert ids from the router's own scores (so gradients still reach the router):

| family        | router class           | scores                  | weights at ids                          |
| glm_moe_dsa   | GlmMoeDsaTopkRouter    | sigmoid(logits)         | normalised, x routed_scaling_factor     |
| deepseek_v3   | DeepseekV3TopkRouter   | sigmoid(logits)         | normalised, x routed_scaling_factor     |
| qwen3_moe     | Qwen3MoeTopKRouter     | softmax(logits)         | normalised if norm_topk_prob            |

All three routers return `(router_logits, topk_weights, topk_ids)`. Replay swaps each router
instance's class for a subclass whose forward still runs the router's own choice (for the
agreement metric and the logits) but returns the replayed ids with weights recomputed at them, so
the load-balancing bias and the group restriction never change a replayed id. State-dict keys
do not change. An unknown family fails loudly. A router called on part of the micro-batch's tokens
(two-batch overlap, `prl.trainer.two_batch`) replays the ids of that part: `tokens(first, end)` says which.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

from prl.model import families
from prl.model.families import FamilySpec


def _sigmoid_weights(router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w = logits.float().sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


def _softmax_weights(router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w = F.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
    if router.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


WEIGHTS_AT: dict[str, Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sigmoid": _sigmoid_weights, "softmax": _softmax_weights}
# the families whose routers prl captures and replays (their specs in `prl.model.families`)
FAMILIES = {t: s for t, s in families.FAMILIES.items() if s.r3}


def family_of(model) -> FamilySpec:
    """The model's family spec; fails loudly for a family without a routing adapter."""
    fam = families.spec(model.config.model_type, "router replay")
    if not fam.r3:
        raise NotImplementedError(f"router replay has no adapter for model_type {fam.model_type!r}; known: "
                                  f"{sorted(FAMILIES)} (add its router to prl.model.families)")
    return fam


def routers(model) -> list[torch.nn.Module]:
    """The model's routers in layer order (replay-wrapped or not); empty for other families."""
    fam = FAMILIES.get(model.config.model_type)
    return families.modules_of(model, fam.router_class) if fam else []


def routing_dtype(num_experts: int) -> torch.dtype:
    """uint8 up to 256 experts, int16 beyond (expert ids < 32768)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


class Capture:
    """Forward hooks that record each router's chosen ids during one forward (engine side)."""

    def __init__(self, model):
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router prl knows; routing capture needs an MoE "
                             f"model of a family in {sorted(FAMILIES)}")
        self.dtype = routing_dtype(self.routers[0].num_experts) if self.routers else torch.uint8
        self._ids: list[torch.Tensor | None] = [None] * len(self.routers)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int):
        def hook(module, args, output):
            self._ids[i] = output[2].detach()

        return hook

    def take(self) -> torch.Tensor:
        """Ids of the last forward as [tokens, layers, k] in the compact dtype."""
        ids = torch.stack([t for t in self._ids], dim=1).to(self.dtype).cpu()  # the wire and the trainer take CPU rows
        self._ids = [None] * len(self.routers)
        return ids

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


_PART: list[tuple[int, int]] = []  # the token range the routers are called on (`tokens`); empty: all of them


@contextlib.contextmanager
def tokens(first: int, end: int):
    """Within the block a router is called on tokens first..end-1 of the micro-batch: it replays their ids."""
    _PART.append((first, end))
    try:
        yield
    finally:
        _PART.pop()


class _ReplayRouter:
    """Mixin placed before the HF router class: replays `_prl_ids` when set (the part `tokens` names)."""

    _prl_ids: torch.Tensor | None = None
    _prl_replay: bool = True
    _prl_stats: list

    def forward(self, hidden_states):
        logits, weights, own = super().forward(hidden_states)
        ids = self._prl_ids
        if ids is None:
            return logits, weights, own
        if _PART:
            ids = ids[slice(*_PART[-1])]
        if ids.shape[0] != own.shape[0]:
            raise RuntimeError(f"R3: {ids.shape[0]} replayed routes for {own.shape[0]} tokens")
        ids = ids.to(own.device).long()
        agree = (own.unsqueeze(-1) == ids.unsqueeze(-2)).any(-2).sum()  # ids the router would also pick
        self._prl_stats.append((agree.detach(), ids.numel()))
        if not self._prl_replay:
            return logits, weights, own
        return logits, self._prl_weights_at(self, logits, ids).to(weights.dtype), ids


class Replay:
    """Installs replay on a model's routers; `use(routing_LNK)` sets the ids for one forward."""

    def __init__(self, model, replay: bool = True):
        fam = family_of(model)
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router ({fam.router_class}); router replay needs an MoE model")
        for r in self.routers:
            if not isinstance(r, _ReplayRouter):  # installing twice (e.g. on a deepcopy) is a no-op
                r.__class__ = type(f"Replay{type(r).__name__}", (_ReplayRouter, type(r)), {})
            r._prl_weights_at, r._prl_replay, r._prl_stats = WEIGHTS_AT[fam.router_scores], replay, []

    def set_replay(self, replay: bool) -> None:
        for r in self.routers:
            r._prl_replay = replay

    @contextlib.contextmanager
    def use(self, routing_LNK: torch.Tensor | None):
        if routing_LNK is not None and routing_LNK.shape[1] != len(self.routers):
            raise ValueError(f"routing has {routing_LNK.shape[1]} MoE layers, the model {len(self.routers)}")
        for i, r in enumerate(self.routers):
            r._prl_ids = None if routing_LNK is None else routing_LNK[:, i, :]
        try:
            yield
        finally:
            for r in self.routers:
                r._prl_ids = None

    @contextlib.contextmanager
    def paused(self):
        """Within the block every router routes by itself and counts nothing, whatever `use` set (the KL
        reference of a LoRA run is this model with its adapters off: it routes its tokens itself, and its
        choices are not the policy's routing agreement)."""
        held = [r._prl_ids for r in self.routers]
        for r in self.routers:
            r._prl_ids = None
        try:
            yield
        finally:
            for r, ids in zip(self.routers, held):
                r._prl_ids = ids

    def agreement(self) -> tuple[float, int]:
        """(ids agreed, ids compared) since the last call."""
        agreed = sum(float(a) for r in self.routers for a, _ in r._prl_stats)
        total = sum(n for r in self.routers for _, n in r._prl_stats)
        for r in self.routers:
            r._prl_stats = []
        return agreed, total

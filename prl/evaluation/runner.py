"""One eval set through a sampler: every example's `samples` completions, scored, as figures.

The figures (an `eval` event's fields, `prl eval --json`'s too): `reward` (mean over samples),
`pass@k`, `best@k` and, where the environment gives answers to vote on, `maj@k` per k of the set
(`prl.evaluation.estimators`), `completion_len` (model tokens per sample), the environment's own
(turns, tool calls, sandbox runs: `prl.envs.stats`), and `later_share`: the share of model tokens
sampled under a weights version newer than the one the set started under (servers take new
weights mid-generation; the figures belong to `version`, the share says how far they are mixed)."""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractAsyncContextManager
from statistics import fmean as mean
from collections.abc import Callable

from prl.envs import Sampler, SkipExample, Trajectory
from prl.envs.stats import summarize
from prl.evaluation.estimators import best_at_k, maj_at_k, pass_at_k
from prl.evaluation.sets import EvalSet
from prl.inference.protocol import GenerateRequest, GenerateResponse

TURN_SEEDS = 64  # turns of one conversation with seeds of their own
EXAMPLE_SEEDS = 1 << 24  # seeds of one example: 256 (1 + 64 x 256 members + 64 turns) fit


class SeededSampler:
    """Gives each request of one example a seed of its own, so a sampled set gives the same samples on the
    same backend: a request for the whole group (no conversation) seed = base, completion j base + j; turn t
    of conversation m (members in the order they first ask) base + 256 (1 + 64 m + t)."""

    def __init__(self, inner: Sampler, base: int):
        self.inner, self.base = inner, base
        self.turns: dict[int, list[int]] = {}  # conversation -> [its member number, turns asked]

    async def generate(self, req: GenerateRequest, conversation: object = None) -> GenerateResponse:
        if req.seed is None and req.temperature > 0:
            req = req.model_copy(update={"seed": self.base + self.offset(conversation)})
        return await self.inner.generate(req, conversation)

    def offset(self, conversation: object) -> int:
        if conversation is None:
            return 0
        member, turn = self.turns.setdefault(id(conversation), [len(self.turns), 0])
        self.turns[id(conversation)][1] += 1
        return 256 * (1 + TURN_SEEDS * member + turn % TURN_SEEDS)


async def run_set(s: EvalSet, sampler_for: Callable[[int], Sampler], gate: AbstractAsyncContextManager,
                  version: int | None, keep: Callable[[list, list], None] | None = None) -> dict:
    """The set's figures at weights `version` (None: the oldest version its tokens carry, the one the
    servers started with); each example runs inside `gate` (which bounds how many are in flight);
    `sampler_for(index)`: the pool bound to one example; `keep(indices, groups)`: given every scored group (a
    skipped example's is None), e.g. to write the completions."""

    async def one(k: int, index: int) -> list[Trajectory] | None:
        async with gate:
            sampler = SeededSampler(sampler_for(index), s.cfg.seed + EXAMPLE_SEEDS * k)
            try:
                return await s.env.rollout(s.env.example(index), sampler)
            except SkipExample:
                return None

    t0 = time.perf_counter()
    groups = await asyncio.gather(*(one(k, i) for k, i in enumerate(s.indices())))
    if keep is not None:
        keep(list(s.indices()), groups)
    kept = [g for g in groups if g is not None]
    if not kept:
        raise SkipExample(f"eval.{s.name}: every example was skipped (prompts longer than task.max_prompt_tokens?)")
    out = figures(kept, s.cfg.pass_k, s.cfg.threshold, version)
    if len(kept) < len(groups):
        out["skipped"] = len(groups) - len(kept)
    return {**out, "wall_s": round(time.perf_counter() - t0, 3)}


def figures(groups: list[list[Trajectory]], ks: list[int], threshold: float, version: int | None) -> dict:
    """The figures of scored groups (one per example, n samples each)."""
    trajs = [t for g in groups for t in g]
    out = {"reward": mean(t.reward for t in trajs)}
    for k in ks:
        out[f"pass@{k}"] = mean(pass_at_k(len(g), sum(t.reward >= threshold for t in g), k) for g in groups)
        out[f"best@{k}"] = mean(best_at_k([t.reward for t in g], k) for g in groups)
        if all(t.answer is not None for t in trajs):
            out[f"maj@{k}"] = mean(maj_at_k([t.answer for t in g], [t.reward >= threshold for t in g], k)
                                   for g in groups)
    model = [v for t in trajs for v, m in zip(t.versions, t.mask or [1] * len(t.versions)) if m]
    out["completion_len"] = len(model) / len(trajs)
    if version is None:
        version = min(model, default=0)
    out["later_share"] = round(sum(v > version for v in model) / max(1, len(model)), 4)
    out.update(summarize([t.info or {} for t in trajs]))
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in out.items()}


"""Rewards from models the run asks: a reward model (`[reward.model]`, `prl.inference.reward_model`) and an LLM judge
(`[reward.judge]`, `prl.orchestrator.judge`).

Rules:
- after the task has scored a group: one `/reward` request for the whole group (each member's prompt, the example's
  as text or chat messages, and its completion decoded, so the reward model reads text in its own tokenizer), and
  one judge request per member;
- each member's reward becomes `reward.task_weight * task reward + weight * score` summed over the models; with
  `normalize = "group"` a model's scores are first their z-scores within the group (0 where they are equal);
- each step logs the means over its samples of the task's reward and each model's score, the models' tokens and
  request seconds;
- a server that fails or hangs is retried as `prl.orchestrator.frozen` says; past its retries, on a request it
  refuses, or where the judge's answer gives no score, the group is dropped and counted (`reward_dropped`,
  `judge_unparsed`), never scored 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics
import time

from prl.backends.base import BackendError
from prl.orchestrator.frozen import FrozenServers


class RewardUnavailable(Exception):
    """A model gave no score for a group: the group is dropped, not trained. `unparsed`: the judge's answers that
    gave no score."""

    def __init__(self, message: str, unparsed: int = 0):
        super().__init__(message)
        self.unparsed = unparsed


def normalized(scores: list[float], normalize: str) -> list[float]:
    """`normalize = "group"`: each score's z-score within its group (0 where the group's scores are equal)."""
    if normalize != "group":
        return scores
    mean, std = statistics.fmean(scores), statistics.pstdev(scores)
    return [(s - mean) / std if std > 0 else 0.0 for s in scores]


def combine(task: list[float], task_weight: float, signals: list[tuple[list[float], float, str]]) -> list[float]:
    """Each member's reward: task_weight * its task reward + the sum over the models' (scores, weight, normalize)
    of weight * its (normalised) score."""
    out = [task_weight * r for r in task]
    for scores, weight, normalize in signals:
        out = [r + weight * s for r, s in zip(out, normalized(scores, normalize))]
    return out


class ModelRewards:
    """A group's rewards from the reward model (`scorer`: its servers) and the judge (`judge`), either may be None."""

    def __init__(self, cfg, tokenizer, scorer: FrozenServers | None = None, judge=None):
        self.cfg, self.tokenizer, self.scorer, self.judge = cfg, tokenizer, scorer, judge  # cfg: the recipe's [reward]

    @property
    def servers(self) -> list[FrozenServers]:
        return [s for s in (self.scorer, self.judge and self.judge.servers) if s is not None]

    def prompt(self, example: dict, traj):
        """The example's prompt: its text, or its chat messages as {role, content} with text contents; a user
        environment's example without one: the prompt as it was sampled, decoded."""
        prompt = example.get("prompt") if isinstance(example, dict) else None
        if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
            return [{"role": str(m.get("role", "user")), "content": m["content"] if isinstance(m.get("content"), str)
                     else str(m.get("content", ""))} for m in prompt]
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(traj.prompt_ids, skip_special_tokens=True)

    async def rewarded(self, example: dict, trajs: list) -> tuple[list, dict]:
        """The group with its rewards combined, and its figures (sums over its members); RewardUnavailable when a
        model gave no score."""
        texts = [self.tokenizer.decode(t.completion_ids, skip_special_tokens=True) for t in trajs]
        prompts = [self.prompt(example, t) for t in trajs]
        task = [t.reward for t in trajs]
        signals, figures = [], {"members": len(trajs), "task_reward": sum(task)}
        if self.scorer is not None:
            scores, more = await self.model_scores([{"prompt": p, "completion": c} for p, c in zip(prompts, texts)])
            signals.append((scores, self.cfg.model.weight, self.cfg.model.normalize))
            figures.update(more)
        if self.judge is not None:
            scores, more = await self.judge_scores(example, prompts, texts)
            signals.append((scores, self.cfg.judge.weight, self.cfg.judge.normalize))
            figures.update(more)
        rewards = combine(task, self.cfg.task_weight, signals)
        return [dataclasses.replace(t, reward=r) for t, r in zip(trajs, rewards)], figures

    async def model_scores(self, items: list[dict]) -> tuple[list[float], dict]:
        t0 = time.monotonic()
        try:
            resp = await self.scorer.call(lambda b: b.reward(items))
        except BackendError as e:
            raise RewardUnavailable(str(e)) from None
        if len(resp.scores) != len(items) or not all(map(math.isfinite, resp.scores)):
            raise RewardUnavailable(f"the reward model answered {len(resp.scores)} scores for {len(items)} members "
                                    f"(or a score that is not finite)")
        return resp.scores, {"reward_model_score": sum(resp.scores), "reward_model_tokens": resp.tokens,
                             "reward_model_s": time.monotonic() - t0}

    async def judge_scores(self, example: dict, prompts: list, texts: list[str]) -> tuple[list[float], dict]:
        """Every member judged, or none. Each request runs to its end (cancelling a request that waits on the judge's
        concurrency gate can lose the gate's wake-up in Python 3.11's asyncio)."""
        t0 = time.monotonic()
        judged = await asyncio.gather(*(self.judge.score(example, p, text) for p, text in zip(prompts, texts)),
                                      return_exceptions=True)
        failed = [e for e in judged if isinstance(e, BaseException)]
        if failed:
            if not isinstance(failed[0], BackendError):
                raise failed[0]  # a user's parser, or prl's own failure
            raise RewardUnavailable(str(failed[0])) from None
        scores = [s for s, _ in judged]
        missing = sum(s is None or not math.isfinite(s) for s in scores)
        if missing:
            raise RewardUnavailable(f"the judge's answer gave no score for {missing} of {len(texts)} members",
                                    unparsed=missing)
        return scores, {"judge_score": sum(scores), "judge_tokens": sum(n for _, n in judged),
                        "judge_s": time.monotonic() - t0}


MEANS = ("task_reward", "reward_model_score", "judge_score")  # per sample
TOTALS = ("reward_model_tokens", "reward_model_s", "judge_tokens", "judge_s")  # per step


def step_figures(groups) -> dict:
    """A step's model-reward figures: the means over its samples of the task's reward and of each model's score,
    the models' tokens and request seconds (nothing without a model)."""
    scored = [g.figures for g in groups if g.figures]
    n = sum(f["members"] for f in scored)
    if not n:
        return {}
    out = {k: sum(f[k] for f in scored) / n for k in MEANS if k in scored[0]}
    return {**out, **{k: round(sum(f[k] for f in scored), 4) for k in TOTALS if k in scored[0]}}

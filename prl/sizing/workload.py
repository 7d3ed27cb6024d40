"""The rollout workload `prl plan` assumes: trajectory lengths, turns, environment tokens and time,
and what async training needs from it (Little's law, the staleness window).

Lengths are stated assumptions (`[plan]` keys, defaulting to what the recipe bounds): a mean and a
p99, with trajectory lengths log-normal between them. The log-normal only serves the token-weighted
means that costs depend on: a long trajectory holds its KV longer and its tokens see more keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prl.envs import env_class, env_workload
from prl.recipe.schema import Recipe

Z99 = 2.3263  # the standard normal's 99th percentile


@dataclass(frozen=True)
class Workload:
    prompt: float  # mean prompt tokens
    model: float  # mean model (sampled) tokens per trajectory, all turns
    env: float  # mean environment tokens per trajectory
    turns: float
    env_seconds: float  # per trajectory, waiting on tools or the sandbox
    p99: float  # p99 trajectory length (prompt + model + environment tokens)
    batch: int  # trajectories per trainer step
    group: int  # trajectories sharing one prompt

    @property
    def mean(self) -> float:
        return self.prompt + self.model + self.env

    @property
    def sigma(self) -> float:
        return lognormal_sigma(self.mean, self.p99)

    @property
    def token_weighted(self) -> float:
        """E[L^2] / E[L]: the mean length of the trajectory a random token belongs to."""
        return self.mean * math.exp(self.sigma ** 2)

    @property
    def inflight_context(self) -> float:
        """Mean KV length of a trajectory in flight (prompt, plus half of what it generates, weighted
        by how long each is in flight)."""
        grown = self.mean - self.prompt
        if grown <= 0:
            return self.prompt
        second = self.mean * self.token_weighted - 2 * self.prompt * self.mean + self.prompt ** 2  # E[(L-P)^2]
        return self.prompt + second / grown / 2

    @property
    def context_cv(self) -> float:
        """Coefficient of variation of the KV length of a trajectory in flight: prompt + u x g, u its
        progress (uniform), g its generated length (log-normal with the same sigma, length-weighted)."""
        g = 2 * (self.inflight_context - self.prompt)  # mean generated length of a trajectory in flight
        spread = g * math.sqrt(max(math.exp(self.sigma ** 2) / 3 - 0.25, 0.0))
        return spread / self.inflight_context if self.inflight_context else 0.0

    @property
    def p99_model(self) -> float:
        """Model tokens of a p99 trajectory (its environment tokens in proportion)."""
        return max(0.0, self.p99 - self.prompt) * self.model / max(self.model + self.env, 1.0)


def lognormal_sigma(mean: float, p99: float) -> float:
    """sigma of the log-normal with this mean and 99th percentile: ln(p99/mean) = z*s - s^2/2, the
    smaller root (a ratio beyond e^(z^2/2) = 15 is taken at its limit)."""
    r = math.log(p99 / mean) if p99 > mean > 0 else 0.0
    return Z99 - math.sqrt(max(Z99 ** 2 - 2 * r, 0.0))


def workload(recipe: Recipe) -> Workload:
    """From the recipe's bounds, what the environment class declares (`Environment.workload`) and the
    `[plan]` keys (each printed with the plan). Multi-turn defaults: env.max_turns turns, a result of
    env.max_env_chars (4 characters a token) after each turn but the last, at most half of
    env.max_total_tokens; the model's tokens a share (plan.completion_fraction) of the rest."""
    pl, env = recipe.plan, env_workload(recipe.env, recipe.sampling)
    prompt = float(pl.prompt_tokens or recipe.task.longest_prompt())
    turns = pl.turns or float(env.turns)
    per_turn = pl.env_tokens_per_turn or env.env_tokens_per_turn
    env_tokens = per_turn * (turns - 1)
    if not pl.env_tokens_per_turn:  # the default: the environment's tokens take at most half the budget
        env_tokens = min(env_tokens, env.max_tokens / 2)
    # one turn: the model's budget is the whole of it (plan keys for turns have no room to take)
    budget = max(env.max_tokens - env_tokens, 1) if env_class(recipe.env.kind).multi_turn else env.max_tokens
    p99 = float(pl.p99_tokens or prompt + env.max_tokens)
    return Workload(prompt, pl.completion_fraction * budget, env_tokens, turns, pl.env_seconds_per_turn * (turns - 1),
                    p99, recipe.rl.batch_size, recipe.rl.group_size)


def in_flight(trajectories_per_s: float, latency_s: float) -> float:
    """Little's law: trajectories in flight = throughput x mean latency."""
    return trajectories_per_s * latency_s


def steps_spanned(latency_s: float, step_s: float) -> int:
    """Trainer steps that pass while a trajectory of this latency runs (at least 1)."""
    return max(1, math.ceil(latency_s / step_s - 1e-9))


def async_cap(recipe: Recipe) -> int:
    """Trajectories the staleness bound lets be in flight: batches s - max_async_level .. s each start
    their rollouts, so max_async_level + 1 batches at once, and at most rl.max_inflight_rollouts."""
    return min((recipe.rl.max_async_level + 1) * recipe.rl.batch_size, recipe.rl.max_inflight_rollouts)

"""The environment seam: `Environment.rollout(example, sampler) -> scored trajectories`.

Rules an environment keeps:
- it samples only through the `Sampler` it is given (token ids in, token ids with logprobs, policy
  versions and routing out: `prl.inference.protocol`), never through a server of its own, so the
  orchestrator's server choice, retries, P/D prefill and staleness accounting apply to every call;
- the token ids it returns as a trajectory's completion are the ids sampled (never re-tokenised
  text), and every completion token carries its logprob and version;
- it returns one trajectory per member of the group, scored (reward in [0, 1]); the orchestrator
  computes advantages over the group and packs them for the trainer.

`env.kind` names the class: a built-in (`prl.envs.BUILTIN`) or a user's `module:Class`; the rest of
prl asks the class, never the name (see `Environment`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from prl.inference.protocol import GenerateRequest, GenerateResponse
from prl.tasks.data import SkipExample  # noqa: F401 - part of the seam: an environment raises it


class Sampler(Protocol):
    """The inference pool as an environment sees it, bound to one group (its server affinity).
    `conversation`: any object naming the conversation a request continues (multi-turn: the episode);
    its turns go to the server that holds its KV, while that one is up and has room."""

    async def generate(self, req: GenerateRequest, conversation: object = None) -> GenerateResponse: ...


@dataclass
class Trajectory:
    """One scored member of a group: the prompt, then every completion token with its inference
    logprob and the policy version that produced it (multi-turn: environment tokens interleaved,
    `mask` 0, logprob 0, version -1); `routing`: the experts the engine used for every input token
    (R3), or None."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    routing: Any = None  # torch.Tensor [tokens, MoE layers, k]
    mask: list[int] | None = None  # per completion token: 1 the model's, 0 the environment's (None: all 1)
    info: dict | None = None  # what the environment wants logged (turns, tool calls, ...)
    # multi-turn: what the episode would have scored had it ended after each model turn (code: each
    # attempt's own outcome), for per-turn credit (`rl.credit = "turn"`); None where it has no meaning
    turn_rewards: list[float] | None = None
    # with turn_rewards: what the environment had answered before each model turn (hashable), so a
    # turn is compared only with the members that reached it in the same state; None: by turn index
    turn_states: list | None = None
    # what the sample answered, for eval sets' majority votes (maj@k; identical answers are one vote):
    # single turn, the completion's text stripped; None: the environment gives nothing to vote on
    answer: str | None = None


@dataclass(frozen=True)
class EnvWorkload:
    """What a trajectory of this environment looks like to `prl plan` and to the recipe's length checks."""

    turns: float  # model turns in a mean trajectory (plan.turns overrides it)
    env_tokens_per_turn: float  # environment tokens after each model turn but the last (plan.env_tokens_per_turn too)
    max_tokens: int  # the most tokens a trajectory holds after its prompt, model and environment tokens together


@dataclass(frozen=True)
class EnvContext:
    """What prl gives an environment when it builds one (`Environment.from_context`), in the
    orchestrator (rollouts) and in the trainer (demonstrations for the warm start)."""

    cfg: Any  # the recipe's [env] (`prl.recipe.schema.EnvCfg`)
    task: Any  # the recipe's task (`prl.tasks.Task`): task.example(index) -> dict, task.reward(text, example) -> float
    tokenizer: Any  # the model's Hugging Face tokenizer
    sampling: Any  # the recipe's [sampling] (`SamplingCfg`: max_tokens per turn, temperature, top_p)
    group_size: int  # trajectories `rollout` returns per example (1 in the trainer)
    router_replay: bool  # R3: ask for routed experts (`return_routing`), return them in `Trajectory.routing`
    sandbox: Any = None  # needs_sandbox: where code runs (`await sandbox.run(code, language="python")`); else None


class Environment(abc.ABC):
    """Examples come from `example(index)`, a pure function of the index (a resumed run continues
    the same data order); `rollout` turns one example into a scored group.

    The seam: what prl asks the class named by `env.kind` (a built-in or a user's `module:Class`),
    checked when the recipe loads, before anything starts:
    - `multi_turn` (bool, required): True when a trajectory has turns (environment tokens between
      the model's, `env.max_turns` and `env.max_total_tokens` bound it; `rl.credit = "turn"` is
      allowed); False for one completion per prompt (`sampling.max_tokens` bounds it);
    - `needs_sandbox` (bool, default False): the run starts sandbox workers (`env.sandbox`, a run
      role of their own) and the environment gets their client as `EnvContext.sandbox`; `prl run`
      and `prl doctor` check the sandbox works first;
    - `workload(cfg, sampling) -> EnvWorkload` (classmethod): turns, environment tokens per turn and
      the longest trajectory, for `prl plan` and the recipe's length checks (the default follows
      `multi_turn` and the `[env]` limits);
    - `from_context(ctx: EnvContext)` (classmethod): how prl builds one; the default calls
      `cls(ctx)`; `MultiTurnEnv` builds its loop from the context, so its subclasses need no
      constructor;
    - `example`, `rollout` (required) and `demonstration` (the warm start's examples: a recipe with
      `sft.steps > 0` is refused for a class without it, `has_demonstrations`).
    """

    multi_turn: ClassVar[bool]
    needs_sandbox: ClassVar[bool] = False

    @classmethod
    def workload(cls, cfg, sampling) -> EnvWorkload:
        if cls.multi_turn:
            return EnvWorkload(turns=cfg.max_turns, env_tokens_per_turn=cfg.max_env_chars // 4,
                               max_tokens=cfg.max_total_tokens)
        return EnvWorkload(turns=1, env_tokens_per_turn=0, max_tokens=sampling.max_tokens)

    @classmethod
    def from_context(cls, ctx: EnvContext) -> "Environment":
        return cls(ctx)

    @classmethod
    def has_demonstrations(cls) -> bool:
        """Whether the class writes `demonstration` (the warm start, `sft.steps > 0`, needs it)."""
        return cls.demonstration is not Environment.demonstration

    @abc.abstractmethod
    def example(self, index: int) -> dict: ...

    @abc.abstractmethod
    async def rollout(self, example: dict, sampler: Sampler) -> list[Trajectory]: ...

    def demonstration(self, index: int) -> Trajectory:
        """A worked example for the supervised warm start (`[sft]`): the model's tokens (mask 1) are
        what it learns to write; environment tokens (mask 0) are context."""
        raise NotImplementedError(f"{type(self).__name__} has no demonstrations: set sft.steps = 0, or write "
                                  f"demonstration(index)")

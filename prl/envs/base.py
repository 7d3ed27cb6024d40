"""The environment seam: `Environment.rollout(example, sampler) -> scored trajectories`.

Rules an environment keeps:
- it samples only through the `Sampler` it is given (token ids in, token ids with logprobs, policy
  versions and routing out: `prl.inference.protocol`), never through a server of its own, so the
  orchestrator's server choice, retries, P/D prefill and staleness accounting apply to every call;
- the token ids it returns as a trajectory's completion are the ids sampled (never re-tokenised
  text), and every completion token carries its logprob and version;
- it returns one trajectory per member of the group, scored (reward in [0, 1]); the orchestrator
  computes advantages over the group and packs them for the trainer.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Protocol

from prl.inference.protocol import GenerateRequest, GenerateResponse


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


class Environment(abc.ABC):
    """Examples come from `example(index)`, a pure function of the index (a resumed run continues
    the same data order); `rollout` turns one example into a scored group."""

    @abc.abstractmethod
    def example(self, index: int) -> dict: ...

    @abc.abstractmethod
    async def rollout(self, example: dict, sampler: Sampler) -> list[Trajectory]: ...

    @abc.abstractmethod
    def demonstration(self, index: int) -> Trajectory:
        """A worked example for the supervised warm start (`[sft]`): the model's tokens (mask 1) are
        what it learns to write; environment tokens (mask 0) are context."""

"""The multi-turn loop: sample, let the environment answer, append its answer as token ids, sample
again, until the model is done, `max_turns`, or the token budget.

Tokens in, tokens out: every request sends the whole history as ids (the server's prefix cache,
salted by version, makes its prefill cost only the new tokens); the model's tokens are kept exactly
as sampled (mask 1, with their logprobs and versions) and the environment's are appended as ids
(mask 0, version -1), never re-tokenised with the history. R3: the engine's routing for every input
token (prompt, model and environment tokens) is collected turn by turn (`routing_start`), so the
trainer's forward replays them all. A trajectory cut by a limit is still scored and trained, marked
truncated; the history never ends in environment tokens (nothing was sampled after them).
"""

from __future__ import annotations

import abc
import asyncio
import inspect
from collections import Counter
from dataclasses import dataclass, field

from prl.envs.base import EnvContext, Environment, Sampler, Trajectory
from prl.inference.protocol import GenerateRequest, decode_routing
from prl.usercode import UserCodeError


@dataclass
class Episode:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # after the prompt: model and environment tokens
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routing: list = field(default_factory=list)  # tensors, one row per input token so far
    turns: int = 0
    truncated: bool = False
    last_text: str = ""  # the model's last turn, decoded
    last_output: str = ""  # code: the last program's output
    outputs: list[str] = field(default_factory=list)  # code: each program's output
    replies: list[str] = field(default_factory=list)  # the environment's answers, as text
    turn_texts: list[str] = field(default_factory=list)  # each model turn as sampled, decoded whole
    stats: Counter = field(default_factory=Counter)
    attempts: list[bool] = field(default_factory=list)  # code: did each program pass

    @property
    def history(self) -> list[int]:
        return self.prompt_ids + self.ids

    def add_model(self, completion) -> None:
        self.ids += completion.token_ids
        self.mask += [1] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self.versions += completion.versions
        self.stats["model_tokens"] += len(completion.token_ids)

    def add_env(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.stats["env_tokens"] += len(ids)


class MultiTurnEnv(Environment):
    """Subclasses say how the environment answers a turn (`respond`) and how an episode scores
    (`score`); `example` comes from the task. Built by `from_context`: the task, tokenizer, turn
    format (`env.format`), sampling, group size, R3 and the limits `env.max_turns`, `env.max_total_tokens`
    (a subclass that needs more overrides `from_context` and calls `cls.context_args(ctx)`)."""

    multi_turn = True

    def __init__(self, task, tokenizer, fmt, sampling, group_size: int, router_replay: bool, max_turns: int,
                 max_total_tokens: int):
        self.task, self.tokenizer, self.fmt, self.sampling = task, tokenizer, fmt, sampling
        self.group_size, self.router_replay = group_size, router_replay
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens

    @classmethod
    def from_context(cls, ctx: EnvContext) -> "MultiTurnEnv":
        return cls(**cls.context_args(ctx))

    @staticmethod
    def context_args(ctx: EnvContext) -> dict:
        """`MultiTurnEnv.__init__`'s arguments from the context."""
        from prl.envs.formats import make_format

        return dict(task=ctx.task, tokenizer=ctx.tokenizer, fmt=make_format(ctx.cfg.format, ctx.tokenizer),
                    sampling=ctx.sampling, group_size=ctx.group_size, router_replay=ctx.router_replay,
                    max_turns=ctx.cfg.max_turns, max_total_tokens=ctx.cfg.max_total_tokens)

    def example(self, index: int) -> dict:
        return self.task.example(index)

    def prompt_ids(self, example: dict) -> list[int]:
        return self.fmt.prompt_ids(example["prompt"], [])

    @abc.abstractmethod
    async def respond(self, ep: Episode, text: str, example: dict) -> list[int] | None:
        """The environment's answer to the model's turn as token ids, or None: the episode is over."""

    @abc.abstractmethod
    def score(self, ep: Episode, example: dict) -> float: ...

    async def rollout(self, example: dict, sampler: Sampler) -> list[Trajectory]:
        episodes = [asyncio.ensure_future(self.episode(example, sampler)) for _ in range(self.group_size)]
        try:
            return list(await asyncio.gather(*episodes))
        except BaseException:  # one member failed (or the group is cancelled): the others stop with it
            for e in episodes:
                e.cancel()
            await asyncio.gather(*episodes, return_exceptions=True)
            raise

    async def episode(self, example: dict, sampler: Sampler) -> Trajectory:
        ep = Episode(self.prompt_ids(example))
        while True:
            await self.sample_turn(ep, sampler)
            reply = await self.checked_respond(ep, example)
            if reply is None:
                break
            if ep.turns >= self.max_turns or len(ep.ids) + len(reply) >= self.max_total_tokens:
                ep.truncated = True  # a limit ends it: scored as it stands, marked
                break
            ep.add_env(reply)
        if self.fmt.templated:  # a long history's template and tokenizer: off the loop
            await asyncio.to_thread(self.count_fork, ep, example)
        return Trajectory(ep.prompt_ids, ep.ids, ep.logprobs, ep.versions, self.checked_score(ep, example),
                          routing=self.routing_of(ep), mask=ep.mask, info=self.info(ep),
                          turn_rewards=self.turn_rewards(ep, example), turn_states=self.turn_states(ep))

    async def checked_respond(self, ep: Episode, example: dict) -> list[int] | None:
        """`respond`'s answer, checked where it crosses into prl: None, or token ids of this tokenizer."""
        name = f"{type(self).__name__}.respond"
        out = self.respond(ep, ep.last_text, example)
        if not inspect.isawaitable(out):
            raise UserCodeError(f"{name} is not a coroutine: write it as `async def respond(...)`")
        reply = await out
        if reply is None:
            return None
        if isinstance(reply, str):
            raise UserCodeError(f"{name} returned text ({reply!r:.40}); it returns token ids or None: "
                                f"self.fmt.reply_ids(\"feedback\", text) encodes an answer")
        if not isinstance(reply, (list, tuple)) or not all(type(i) is int for i in reply):
            raise UserCodeError(f"{name} returned {type(reply).__name__} ({reply!r:.40}); it returns token ids "
                                f"(a list of int) or None")
        vocab = len(self.tokenizer)
        bad = next((i for i in reply if not 0 <= i < vocab), None)
        if bad is not None:
            raise UserCodeError(f"{name} returned token id {bad}, outside the tokenizer's {vocab} ids")
        return list(reply)

    def checked_score(self, ep: Episode, example: dict) -> float:
        from prl.tasks import users_reward

        return users_reward(self.score(ep, example), f"{type(self).__name__}.score")

    async def sample_turn(self, ep: Episode, sampler: Sampler) -> None:
        held = sum(len(r) for r in ep.routing)  # input positions whose routing this episode holds
        req = GenerateRequest(
            prompt_ids=ep.history, max_tokens=max(1, min(self.sampling.max_tokens, self.max_total_tokens - len(ep.ids))),
            temperature=self.sampling.temperature, top_p=self.sampling.top_p, n=1,
            return_routing=self.router_replay, routing_start=held, final=ep.turns + 1 >= self.max_turns,
        )
        resp = await sampler.generate(req, conversation=ep)
        c = resp.completions[0]
        if resp.prompt_routing is not None:
            ep.routing += [decode_routing(resp.prompt_routing), decode_routing(c.routing)]
        ep.add_model(c)
        ep.turns += 1
        ep.last_text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        ids = c.token_ids[:-1] if c.token_ids and c.token_ids[-1] == self.tokenizer.eos_token_id else c.token_ids
        ep.turn_texts.append(self.tokenizer.decode(ids, skip_special_tokens=False))

    def prompt_tools(self) -> list:
        """The tools the first prompt shows (tools environments)."""
        return []

    reply_kind = "feedback"  # how the environment's answers render: "tool" results or "feedback"

    def count_fork(self, ep: Episode, example: dict) -> None:
        """`retokenize_forks`: whether rendering the conversation with the chat template and tokenizing it
        again (what frameworks that re-tokenise the history train on) gives other ids than the ones prl
        keeps and trains, the sampled ones. Only for formats with a chat template (`fmt.templated`)."""
        n = ep.turns - 1  # replies appended between turns (one more may have been cut by a limit)
        rendered = self.fmt.render_ids(example["prompt"], self.prompt_tools(), ep.turn_texts, ep.replies[:n],
                                       self.reply_kind)
        ep.stats["retokenize_forks"] += int(rendered[:len(ep.history)] != ep.history)

    def turn_rewards(self, ep: Episode, example: dict) -> list[float] | None:
        """Per model turn, the score had the episode ended there (None: only the end is scored)."""
        return None

    def turn_states(self, ep: Episode) -> list | None:
        """Per model turn, the state it started from, for its baseline (None: turns by index only)."""
        return None

    @staticmethod
    def routing_of(ep: Episode):
        if not ep.routing:
            return None
        import torch

        return torch.cat(ep.routing)

    def model_turn(self, ep: Episode, text: str, learn: bool = True) -> None:
        """A demonstration's model turn: `text` and the end-of-turn token; learned (mask 1), or kept as
        context only (a wrong first try the demonstration then fixes)."""
        ids = self.tokenizer(text, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]
        ep.ids += ids
        ep.mask += [int(learn)] * len(ids)

    def env_turn(self, ep: Episode, ids: list[int]) -> None:
        ep.ids += ids
        ep.mask += [0] * len(ids)

    def demo(self, ep: Episode, reward: float = 1.0) -> Trajectory:
        n = len(ep.ids)
        return Trajectory(ep.prompt_ids, ep.ids, [0.0] * n, [0] * n, reward, mask=ep.mask)

    def info(self, ep: Episode) -> dict:
        return {"turns": ep.turns, "truncated": ep.truncated, "attempts": ep.attempts, **ep.stats}

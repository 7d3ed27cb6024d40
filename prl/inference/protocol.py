"""Typed wire messages of the inference HTTP API (shared by the embedded server and clients)."""

from __future__ import annotations

import base64
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


SEED_LIMIT = 2**63 - 256  # torch generators take 64-bit seeds; seed + i must stay below 2**63


class Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateRequest(Msg):
    """Token in, token out."""

    prompt_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    max_tokens: int = Field(16, gt=0)
    temperature: float = Field(1.0, ge=0, le=100, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    stop_token_ids: list[int] | None = None  # None: the tokenizer's EOS
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)  # completion i uses seed + i
    n: int = Field(1, gt=0, le=256)  # completions of the same prompt (a GRPO group in one request)
    return_routing: bool = False  # R3: experts chosen per input token and MoE layer
    routing_start: int = Field(0, ge=0)  # prompt positions the client already holds (multi-turn)
    # answer as NDJSON: a `{"member": i}` line as each completion finishes, then the GenerateResponse
    # (the embedded engine; a group's finished members free their places in the orchestrator's budget)
    stream_members: bool = False
    # no later request extends these completions (a single-turn rollout, a conversation's last turn): the
    # embedded engine keeps none of their KV for reuse when they finish (vLLM's prefix cache ignores it)
    final: bool = False


class Routing(Msg):
    """A [tokens, MoE layers, k] array of expert ids, raw little-endian bytes in base64."""

    data: str
    shape: list[int]
    dtype: Literal["uint8", "int16"]


class Completion(Msg):
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # policy version that produced each token
    finish_reason: str
    routing: Routing | None = None  # completion tokens fed back as inputs (all but the last)


class GenerateResponse(Msg):
    completions: list[Completion]
    prompt_routing: Routing | None = None  # once per request, from `routing_start`


def encode_routing(ids) -> Routing:
    """torch tensor -> wire. Copies: tensor bytes, then base64 text."""
    arr = ids.contiguous().numpy()
    return Routing(data=base64.b64encode(arr.tobytes()).decode(), shape=list(arr.shape), dtype=str(arr.dtype))


def decode_routing(msg: Routing):
    """wire -> torch tensor, viewing the decoded bytes without another copy."""
    import numpy as np
    import torch

    raw = bytearray(base64.b64decode(msg.data))
    return torch.from_numpy(np.frombuffer(raw, dtype=msg.dtype).reshape(msg.shape))


class ChatMessage(Msg):
    role: str = Field(min_length=1, max_length=64)
    content: str


class CompletionRequest(BaseModel):
    """The OpenAI /v1/completions request. What the engine does not do (streaming, best_of, penalties,
    more than the sampled token's logprob, unknown fields) is refused with a 400 naming it, never
    silently ignored (`unsupported`). `echo` returns the prompt before each completion, with its tokens'
    logprobs when `logprobs` is set (the first is null); with `max_tokens = 0` nothing is generated:
    the prompt scored, as a teacher's scoring uses it."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    max_tokens: int = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0, le=100, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    n: int = Field(1, gt=0, le=64)
    stop: str | list[str] | None = None
    logprobs: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stream: bool = False
    echo: bool = False
    best_of: int | None = None
    user: str | None = None  # metadata; accepted and unused

    def unsupported(self) -> str | None:
        """The first field asking for something the engine does not do, with the reason."""
        if self.stream:
            return "stream: streaming is not supported; send stream=false"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens: 0 generates nothing; it goes with echo=true (the prompt's logprobs)"
        if self.best_of not in (None, 1):
            return "best_of: not supported (use n)"
        if self.logprobs is not None and self.logprobs > 1:
            return "logprobs: only the sampled token's logprob is returned (logprobs 0 or 1)"
        for key, value in (self.model_extra or {}).items():
            if value not in (None, 0, 0.0, False, {}, []):
                return f"{key}: not supported by prl's engine"
        return None


class ChatCompletionRequest(CompletionRequest):
    """OpenAI's /v1/chat/completions: the messages rendered by the served tokenizer's chat template (without one,
    their contents joined by newlines), then as /v1/completions. `max_completion_tokens` is OpenAI's newer name."""

    prompt: None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _newer_name(self):
        if self.max_completion_tokens:
            self.max_tokens = self.max_completion_tokens
        return self

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo: not part of the chat API (use /v1/completions)"
        if self.max_tokens == 0:
            return "max_tokens: a chat completion writes at least one token"
        return super().unsupported()


class UpdateWeightsRequest(Msg):
    version: int
    path: str | None = None  # a folder this server can read; None: its configured weight source


class PrefillRequest(Msg):
    """P/D: compute the prompt's KV (and routing) into the run's KV pool; a decode server loads it."""

    prompt_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)


class ScoreItem(Msg):
    """The logprob of each token of `ids` from `start` on, given the tokens before it."""

    ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=2)
    start: int = Field(1, ge=1)  # the first position scored (its token given ids[:start])


class ScoreRequest(Msg):
    """Sequences scored under the served weights in one forward, nothing generated (a teacher scoring a group of a
    student's sampled trajectories)."""

    items: list[ScoreItem] = Field(min_length=1, max_length=16384)


class ScoreResponse(Msg):
    logprobs: list[list[float]]  # per item, one per token of its ids[start:]
    version: int  # the weights version that scored them


class PrefillResponse(Msg):
    version: int  # the weights version the KV was computed under (part of its pool keys)
    pooled_tokens: int  # prompt tokens now in the pool (full chunks)


class UpdateWeightsResponse(Msg):
    version: int
    load_s: float
    source: Literal["folder", "collective", "served"] = "folder"  # the staged stream, the folder, or served already


class CollectiveJoin(Msg):
    """Join the trainer's weight group (`prl.transport.collective.GroupInfo`)."""

    addr: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)
    world: int = Field(ge=2, le=65536)
    rank: int = Field(ge=1)
    epoch: int = Field(ge=1)
    timeout_s: float = Field(120.0, gt=0, le=3600)
    backend: Literal["gloo", "nccl"] = "gloo"
    senders: int = Field(1, ge=1, le=65535)  # group ranks 0..senders-1 are trainer ranks

    @model_validator(mode="after")
    def _a_receiver(self):
        if not self.senders <= self.rank < self.world:
            raise ValueError(f"rank {self.rank}: a receiver's rank is in [senders, world) = [{self.senders}, {self.world})")
        return self


class CollectiveReceive(Msg):
    version: int = Field(ge=0)
    epoch: int = Field(ge=1)


class Health(Msg):
    ok: bool
    version: int


class Metrics(Msg):
    version: int
    running: int
    waiting: int
    paused: bool
    generated_tokens: int
    prompt_tokens: int
    prefill_tokens: int  # prompt tokens computed (not reused from the prefix cache or the KV pool)
    prefix_hits: int  # prefills that reused local prefix-cache KV (embedded engine; vLLM: hit tokens)
    weight_loads: int
    tokens_per_s: float
    busy_frac: float
    busy_s: float
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the local prefix cache (embedded engine)
    pool_hit_tokens: int = 0  # prompt tokens loaded from the KV pool instead of computed
    pool_stored_chunks: int = 0
    pool_errors: int = 0  # failed store operations (each falls back to computing the prompt)
    pool_full: int = 0  # puts the pool refused because it was full
    pool_dropped: int = 0  # chunks not put because puts fell behind prefill (embedded engine)
    kv_usage: float | None = None  # KV held over capacity (vLLM: the fullest engine's); None: unbounded
    collective_staged: int = 0  # versions staged from the collective weight path
    weights_skipped: int = 0  # versions asked for while the server held a newer one, which it served instead
    collective_receiving: int = -1  # tensors received of the version on the wire now (-1: none)
    decode_steps: int = 0  # embedded engine: batch decode forwards
    prefill_forwards: int = 0  # embedded engine: forwards that computed prompt tokens


class RewardItem(Msg):
    """One sampled conversation: the prompt (text, or chat messages) and the completion the policy wrote."""

    prompt: str | list[ChatMessage]
    completion: str


class RewardRequest(Msg):
    """Score conversations with the served reward model (`prl.inference.reward_model`), one forward for all."""

    items: list[RewardItem] = Field(min_length=1, max_length=16384)


class RewardResponse(Msg):
    scores: list[float]  # one per item, in order
    tokens: int  # the reward model's tokens scored (its own tokenizer's)

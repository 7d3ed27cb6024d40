"""An LLM judge (`[reward.judge]`): a model asked, for each sampled completion, to rate it with the recipe's rubric;
its answer parsed to a score (`prl.orchestrator.rewards` combines it with the task's reward).

Rules:
- one /chat/completions request per completion (OpenAI's API: a judge the run serves on prl's embedded engine, or
  any OpenAI-compatible server at `base_url`), the template filled with the example's prompt (as text), the
  completion and the example's answer, sent as one user message; at most `concurrency` in flight;
- the score is the first group of `score_regex`'s last match in the answer, or what the user's `parser` returns;
  an answer that gives none is counted (`judge_unparsed`) and its group dropped, never scored 0;
- a request that fails is sent again (`prl.orchestrator.frozen`); one unanswered too long too: a judge the run serves
  past `run.hang_timeout_s` is reported hung and restarted, an outside judge is given three `timeout_s`;
- the API key of an outside judge comes from the environment variable `api_key_env` names, read here, written nowhere.
"""

from __future__ import annotations

import asyncio
import os
import re

import httpx

from prl.backends.base import NEVER_SENT, BackendError, MalformedResponse, post_safely, wait_healthy
from prl.orchestrator.frozen import FrozenServers
from prl.tasks import function_name
from prl.tasks.prompts import raw_text
from prl.usercode import UserCodeError


class ChatServer:
    """One OpenAI-compatible endpoint: `base_url` ends where "/chat/completions" is appended ("http://h:p/v1")."""

    def __init__(self, base_url: str, key: str | None, health_url: str | None = None):
        self.base_url, self.health_url = base_url.rstrip("/"), health_url
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(None, connect=10.0))

    async def wait_ready(self, timeout: float) -> None:
        """A judge the run serves: until its /health answers; an outside judge is taken as it is."""
        if self.health_url is not None:
            await wait_healthy(self.http, self.health_url, timeout, lambda: f"judge server {self.base_url}")

    async def chat(self, body: dict) -> tuple[str, int]:
        """The judge's answer and the tokens it cost (prompt and completion, as the server's usage says)."""
        url = f"{self.base_url}/chat/completions"
        r = await post_safely(self.http, url, body, NEVER_SENT)  # sent again only if it never left: it may be billed
        if r.status_code >= 400:
            raise BackendError(f"{url} answered {r.status_code}: {r.text[:300]}", r.status_code)
        try:
            answer = r.json()
            usage = answer.get("usage") or {}
            return str(answer["choices"][0]["message"]["content"] or ""), int(usage.get("total_tokens") or 0)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            raise MalformedResponse(f"{url}: not a chat completion ({type(e).__name__}: {e})") from None

    async def close(self) -> None:
        await self.http.aclose()


class Judge:
    def __init__(self, cfg, servers: FrozenServers, parse=None):
        self.cfg, self.servers = cfg, servers  # cfg: the recipe's [reward.judge]
        self.pattern = re.compile(cfg.score_regex)
        self.parse = parse  # the user's parser, or None: score_regex
        self.gate = asyncio.Semaphore(cfg.concurrency)

    def message(self, example: dict, prompt, completion: str) -> str:
        """The template filled: `prompt` as text (chat messages' contents joined), the example's answer."""
        answer = example.get("answer", "") if isinstance(example, dict) else ""
        return self.cfg.template.format(prompt=raw_text(prompt), completion=completion,
                                        answer="" if answer is None else str(answer))

    def score_of(self, text: str, example: dict) -> float | None:
        if self.parse is not None:
            value = self.parse(text, example)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise UserCodeError(f"{function_name(self.parse)} (reward.judge.parser) returned "
                                    f"{type(value).__name__}; it returns a number, or None for no score")
            return value
        found = self.pattern.findall(text)
        if not found:
            return None
        last = found[-1]
        try:
            return float(last[0] if isinstance(last, tuple) else last)
        except ValueError:
            return None

    async def score(self, example: dict, prompt, completion: str) -> tuple[float | None, int]:
        """The judge's score of one completion of `prompt` (None: its answer gave none) and the tokens it cost."""
        message = {"role": "user", "content": self.message(example, prompt, completion)}
        body = {"model": self.cfg.model, "messages": [message], "max_tokens": self.cfg.max_tokens,
                "temperature": self.cfg.temperature}
        async with self.gate:
            text, tokens = await self.servers.call(lambda server: server.chat(body))
        return self.score_of(text, example), tokens


def judge_servers(cfg, served: list[str], secret: str) -> list[ChatServer]:
    """The judge's endpoints: the run's judge-N servers (their /v1, the run's key), or the outside `base_url` with
    the key from `api_key_env`."""
    if served:
        return [ChatServer(f"{url}/v1", secret, health_url=f"{url}/health") for url in served]
    key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
    return [ChatServer(cfg.base_url, key)]

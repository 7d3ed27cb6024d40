"""The inference-backend seam: what the orchestrator needs from one server, whatever engine runs it.

Rules every backend keeps:
- `generate` returns, per completion, every token's logprob (temperature-scaled, before top-p: what
  the trainer recomputes), the policy version that produced it, and (when asked) the experts it
  was routed to, in prl's wire types (`prl.inference.protocol`);
- `load_weights(v)` is an in-flight update: running requests keep their KV and continue under v;
  requests started after it never reuse prefix KV computed under an older version; a rejected
  version raises `WeightsRejected` and the old one keeps serving;
- a server that died or stopped answering raises `BackendError` naming it, never hangs.

Backends are registered in `prl.backends.registry` (client class, launch command, publish format,
refusals, doctor checks); `prl.backends.registry.make_backend(kind, ...)` makes a client.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Callable

import httpx

from prl.inference.protocol import GenerateRequest, GenerateResponse, Metrics


class BackendError(RuntimeError):
    """A server failed a request or stopped answering; the message names the server. `status`: the
    HTTP status it answered with, None when it did not answer (refused, reset, timed out)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    @property
    def client_error(self) -> bool:
        """The server answered that the request itself is wrong (4xx): no other server would take it."""
        return self.status is not None and 400 <= self.status < 500


class MalformedResponse(BackendError):
    """A server answered something prl cannot use (a protocol mismatch, not a dead server)."""


class WeightsRejected(BackendError):
    """A server refused a weights version; it keeps serving the version it had."""


class InferenceBackend(abc.ABC):
    """One inference server, reached over HTTP with the run's bearer secret."""

    def __init__(self, base_url: str, secret: str, max_connections: int = 128):
        self.base_url = base_url
        self.http = httpx.AsyncClient(
            base_url=base_url,
            headers={"Authorization": f"Bearer {secret}"},
            timeout=httpx.Timeout(600.0, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self.version = -1  # the policy version this server serves, as far as this client knows
        self.locate: Callable[[], str] | None = None  # where the server listens now (it may move on a restart)

    @abc.abstractmethod
    async def wait_ready(self, timeout: float) -> None:
        """Return once the server answers requests (raise `BackendError` after `timeout`)."""

    @abc.abstractmethod
    async def generate(self, req: GenerateRequest) -> GenerateResponse: ...

    @abc.abstractmethod
    async def load_weights(self, version: int) -> float:
        """Load `version` in flight; returns the seconds the server was paused for it."""

    @abc.abstractmethod
    async def metrics(self) -> Metrics: ...

    def reset(self) -> None:
        """Forget what this client knew about the server's state: the server restarted."""
        self.version = -1

    async def close(self) -> None:
        await self.http.aclose()

    async def post(self, path: str, body: dict | None = None, attempts: int = 3, **kw) -> httpx.Response:
        """POST, retrying transport errors (a keep-alive connection closed under us is not a dead
        server; a dead server fails every attempt and the error surfaces, naming it)."""
        for attempt in range(attempts):
            try:
                return await self.http.post(path, json=body, **kw)
            except httpx.TransportError as e:
                if attempt == attempts - 1:
                    raise BackendError(f"{self.base_url}{path}: {type(e).__name__}: {e}") from None
                await asyncio.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    async def get(self, path: str) -> httpx.Response:
        try:
            return await self.http.get(path)
        except httpx.TransportError as e:
            raise BackendError(f"{self.base_url}{path}: {type(e).__name__}: {e}") from None

    def retarget(self) -> None:
        """Follow the server to where it listens now (`locate`; a restarted server may have moved off a
        taken port)."""
        url = self.locate() if self.locate else self.base_url
        if url != self.base_url:
            self.base_url = self.http.base_url = url

    async def poll_health(self, timeout: float, path: str = "/health") -> None:
        """Wait until `path` answers 200; transport errors mean the server is still starting."""
        deadline = time.monotonic() + timeout
        while True:
            self.retarget()
            try:  # a health check answers at once; a listener that does not is not the server
                r = await self.http.get(path, timeout=httpx.Timeout(5.0, connect=5.0))
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise BackendError(f"inference server {self.base_url} not healthy after {timeout:.0f}s")
            await asyncio.sleep(0.2)

    def check(self, r: httpx.Response, what: str) -> httpx.Response:
        if r.status_code >= 400:
            raise BackendError(f"{self.base_url}: {what} answered {r.status_code}: {r.text[:300]}", r.status_code)
        return r

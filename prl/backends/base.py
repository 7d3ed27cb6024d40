"""The inference-backend seam: what the orchestrator needs from one server, whatever engine runs it.

Rules every backend keeps:
- `generate` returns, per completion, every token's logprob (temperature-scaled, before top-p: what
  the trainer recomputes), the policy version that produced it, and (when asked) the experts it
  was routed to, in prl's wire types (`prl.inference.protocol`);
- `load_weights(v)` is an in-flight update: running requests keep their KV and continue under v;
  requests started after it never reuse prefix KV computed under an older version; a rejected
  version raises `WeightsRejected` and the old one keeps serving;
- a server that died or stopped answering raises `BackendError` naming it, never hangs; one left in a
  state only a restart fixes (paused by a failed weight load or `/resume`) raises `ServerStuck`;
- a request is sent again only when it cannot have reached the server (connection refused, connect
  timeout), or when repeating it is harmless (`repeatable`: a generation whose connection broke is
  dropped by the server; never after a read timeout, when the first may still be running);
- a generation has a deadline: `GENERATE_FLOOR_S` plus `GENERATE_SLACK` times its `max_tokens` at
  the slowest seconds per token of this server's recent generations; past it the request is
  cancelled, which closes its connection, and the server drops the generation.

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


class ServerStuck(BackendError):
    """A server that answers but will not serve again until it is restarted (left paused after a
    weight load failed half way, or after `/resume` failed): take it out and restart it."""


NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)  # the request never left the client
BROKEN = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)  # the connection broke under the request
GENERATE_FLOOR_S = 60.0
GENERATE_SLACK = 4.0
UNMEASURED_S = 600.0  # a server's first generations, before any pace is known


class Pace:
    """Seconds per generated token of a server's recent generations (a request's wall time, queueing
    included, over its longest completion), and the deadline a new generation gets from it."""

    def __init__(self, floor_s: float = GENERATE_FLOOR_S, slack: float = GENERATE_SLACK, window: int = 64):
        self.floor_s, self.slack, self.window = floor_s, slack, window
        self.recent: list[float] = []

    def record(self, seconds: float, tokens: int) -> None:
        self.recent = [*self.recent, seconds / max(tokens, 1)][-self.window:]

    def deadline(self, max_tokens: int) -> float:
        if not self.recent:
            return max(UNMEASURED_S, self.floor_s)
        return self.floor_s + self.slack * max_tokens * max(self.recent)


async def post_safely(http: httpx.AsyncClient, path: str, body: dict | None, retry: tuple, attempts: int = 3,
                      where: str = "", **kw) -> httpx.Response:
    """POST, sent again after a transport error of a kind in `retry` (0.2 s, 0.4 s, ...); any other, or the last,
    is a BackendError naming `where`."""
    for attempt in range(attempts):
        try:
            return await http.post(path, json=body, **kw)
        except httpx.TransportError as e:
            if attempt == attempts - 1 or not isinstance(e, retry):
                raise BackendError(f"{where or path}: {type(e).__name__}: {e}") from None
            await asyncio.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


async def wait_healthy(http: httpx.AsyncClient, path: str, timeout: float, name: Callable[[], str],
                       before: Callable[[], None] = lambda: None) -> None:
    """Until `path` answers 200 (`before` runs ahead of each look); transport errors mean the server is still
    starting; past `timeout` a BackendError naming the server (`name()`)."""
    deadline = time.monotonic() + timeout
    while True:
        before()
        try:  # a health check answers at once; a listener that does not is not the server
            r = await http.get(path, timeout=httpx.Timeout(5.0, connect=5.0))
            if r.status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise BackendError(f"{name()} not healthy after {timeout:.0f}s")
        await asyncio.sleep(0.2)


class InferenceBackend(abc.ABC):
    """One inference server, reached over HTTP with the run's bearer secret."""

    def __init__(self, base_url: str, secret: str, max_connections: int = 128):
        self.base_url = base_url
        self.http = httpx.AsyncClient(
            base_url=base_url,
            headers={"Authorization": f"Bearer {secret}"},
            timeout=httpx.Timeout(600.0, connect=10.0),
            # idle connections are dropped before a server's keep-alive timeout (uvicorn's 5 s) would close
            # one under a new request: a request on a connection that broke is not sent again
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=2.0),
        )
        self.version = -1  # the policy version this server serves, as far as this client knows
        self.locate: Callable[[], str] | None = None  # where the server listens now (it may move on a restart)
        self.pace = Pace()

    @abc.abstractmethod
    async def wait_ready(self, timeout: float) -> None:
        """Return once the server answers requests (raise `BackendError` after `timeout`)."""

    generate_path = "/generate"

    @abc.abstractmethod
    def generate_body(self, req: GenerateRequest) -> dict: ...

    @abc.abstractmethod
    def parse_generate(self, r: httpx.Response, req: GenerateRequest) -> GenerateResponse: ...

    async def generate(self, req: GenerateRequest,
                       on_member: Callable[[int], None] | None = None) -> GenerateResponse:
        """One generation, within its deadline (`Pace`); past it the request is cancelled (its connection
        closes: the server drops the generation) and `BackendError` names the server. `on_member(i)` is
        called as member i finishes, where the backend streams them (`send_generate`)."""
        deadline, t0 = self.pace.deadline(req.max_tokens), time.monotonic()
        try:
            async with asyncio.timeout(deadline):
                resp = await self.send_generate(req, on_member)
        except TimeoutError:
            raise BackendError(f"{self.base_url}{self.generate_path}: no answer within {deadline:.0f}s "
                               f"(max_tokens {req.max_tokens} at this server's measured pace); cancelled") from None
        self.pace.record(time.monotonic() - t0, max((len(c.token_ids) for c in resp.completions), default=0))
        return resp

    async def send_generate(self, req: GenerateRequest, on_member: Callable[[int], None] | None) -> GenerateResponse:
        """The request and its parsed answer, all members at once (`on_member` is not called)."""
        r = await self.post(self.generate_path, self.generate_body(req), repeatable=True,
                            timeout=httpx.Timeout(None, connect=10.0))
        return self.parse_generate(self.check(r, self.generate_path), req)

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

    async def post(self, path: str, body: dict | None = None, attempts: int = 3, repeatable: bool = False,
                   **kw) -> httpx.Response:
        """POST; sent again only where that is safe: a request that never left (connection refused,
        connect timeout), or, when `repeatable`, one whose connection broke (the server drops what it
        was doing for it). Never after a read timeout: the first may still be running. A dead server
        fails every attempt and the error surfaces, naming it."""
        return await post_safely(self.http, path, body, NEVER_SENT + BROKEN if repeatable else NEVER_SENT, attempts,
                                 where=f"{self.base_url}{path}", **kw)

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
        await wait_healthy(self.http, path, timeout, lambda: f"inference server {self.base_url}", self.retarget)

    def check(self, r: httpx.Response, what: str) -> httpx.Response:
        if r.status_code >= 400:
            raise BackendError(f"{self.base_url}: {what} answered {r.status_code}: {r.text[:300]}", r.status_code)
        return r

"""The inference servers as the orchestrator sees them: which take requests, and watching them.

Rules:
- a server that fails a request without answering (refused, reset), answers 5xx, or stops answering
  `/metrics` for `run.hang_timeout_s` is taken out: its in-flight requests are cancelled and their
  groups re-issued to the servers still up (a run with one server waits for it);
- a hung server is reported to the driver (an `unresponsive` event), which kills and restarts it;
  so is a stuck one (`ServerStuck`: left paused by a weight load that failed half way, or by a
  `/resume` that failed), at once; a dead one the driver sees exit and restarts by itself; the run
  goes on meanwhile (with `run.max_restarts = 0` the driver stops it, naming the server);
- a server comes back once it answers `/health` again and has loaded the version being served, so
  no request ever runs on stale or half-loaded weights;
- a 4xx answer is the request's fault, not the server's: it is raised, never retried elsewhere;
- "stuck" means stuck: a server that answers why it did not load a version (missed the stream, a
  newer one held) is at most taken out until the next version, never reported for a restart; only
  one that does not answer within `run.hang_timeout_s`, or whose load failed after it began to
  change the model, is;
- servers may serve different versions for a moment: one asked for vN that holds a newer version
  (the trainer streamed it first) serves the newer, logged as `weights_skipped`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from prl.backends.base import BackendError, InferenceBackend, MalformedResponse, ServerStuck, WeightsRejected
from prl.metrics import EventLog

MAX_ATTEMPTS = 8  # a group that failed this often on servers that kept coming back ends the run


class Server:
    def __init__(self, index: int, backend: InferenceBackend, prefill: bool = False):
        self.index, self.backend = index, backend
        self.prefill = prefill  # P/D: puts prompts' KV into the pool, generates nothing
        self.name = f"inference-{index}"
        self.up = False
        self.calls: set[asyncio.Task] = set()  # requests in flight on it, cancelled when it goes down
        self.down_since = time.monotonic()  # for reporting a server that does not come back
        self.prefill_timeouts = 0  # consecutive prefills it did not answer in time
        self.active = 0  # sequences its requests have out

    def track(self, coro: Awaitable) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.calls.add(task)
        task.add_done_callback(self.calls.discard)
        return task


class Held:
    """The sequences one request has out on a server (`Server.active`), released member by member
    as a streaming backend reports each finished, and the rest when the request ends."""

    def __init__(self, server: Server, n: int):
        self.server, self.n = server, n
        server.active += n

    def release(self, k: int = 1) -> None:
        k = min(k, self.n)
        self.n -= k
        self.server.active -= k


class Home:
    """Where a group's conversation last ran, so its KV is there: its next turn goes there too."""

    def __init__(self):
        self.server: Server | None = None


PREFILL_TIMEOUTS = 3  # a prefill server this many prefills in a row late is taken as hung


class ServerPool:
    def __init__(self, backends: list[InferenceBackend], log: EventLog, changed: asyncio.Condition,
                 hang_timeout_s: float, startup_timeout_s: float = 600.0, prefill: list[int] = ()):
        self.servers = [Server(i, b, prefill=i in prefill) for i, b in enumerate(backends)]
        self.log, self.changed, self.hang_timeout_s = log, changed, hang_timeout_s
        self.startup_timeout_s = startup_timeout_s  # a down server not back after this is reported hung
        self.weights_lock = asyncio.Lock()  # a rejoin loads the served version; a relay may not change it meanwhile
        self.served = -1
        self.on_metrics: Callable[[Server, object], None] = lambda server, metrics: None
        # whether a server can take n more sequences (the orchestrator's per-server in-flight limit)
        self.room: Callable[[Server, int], bool] = lambda server, n: True

    # ---- membership ----
    async def start(self, timeout: float) -> None:
        """Wait for the servers at startup; those not ready are left to the monitor (they rejoin)."""
        results = await asyncio.gather(*(s.backend.wait_ready(timeout) for s in self.servers), return_exceptions=True)
        for s, r in zip(self.servers, results):
            if isinstance(r, BaseException) and not isinstance(r, BackendError):
                raise r
            s.up = not isinstance(r, BaseException)
        if not any(s.up for s in self.servers):
            raise next(r for r in results if isinstance(r, BaseException))

    async def mark_down(self, server: Server, cause: str, hung: bool = False, stuck: bool = False) -> None:
        """Take `server` out; a hung or stuck one is reported for the driver to restart."""
        if not server.up:
            return
        server.up, server.down_since = False, time.monotonic()
        for task in list(server.calls):
            task.cancel()
        self.log.emit("server_state", name=server.name, state="down", cause=("hung: " if hung else "") + cause[:300])
        if hung or stuck:
            self.log.emit("unresponsive", name=server.name, cause=cause[:300], stuck=stuck)
        async with self.changed:
            self.changed.notify_all()

    async def pick(self, index: int, home: Server | None = None, n: int = 1) -> Server:
        """A decode server for n sequences of group `index`: the one its conversation ran on (`home`,
        which holds its KV), else the group's own (index modulo their number), while that one is up
        and has room (`room`); else, among those up, one with room, the least busy; waits while none
        is up."""
        kind = [s for s in self.servers if not s.prefill]
        async with self.changed:
            await self.changed.wait_for(lambda: any(s.up for s in kind))
        own = home if home is not None else kind[index % len(kind)]
        if own.up and self.room(own, n):
            return own
        chosen = min((s for s in kind if s.up), key=lambda s: (not self.room(s, n), s.active, len(s.calls)))
        if home is not None and not home.up:  # a fault moves the conversation (a full server: not logged)
            self.log.emit("moved", group=index, name=home.name, to=chosen.name)
        return chosen

    async def prefill(self, index: int, prompt_ids: list[int]) -> None:
        """P/D: have a prefill server put the prompt's KV into the pool, where the decode server
        finds it under the same weights version (another version's keys never match: it computes).
        Best effort: with the prefill servers down, failing, refusing the prompt or slower than
        `hang_timeout_s`, the decode server computes it all (a failing server is marked down, the
        rest is logged as a `prefill_skipped` event; `PREFILL_TIMEOUTS` late ones in a row mark it hung)."""
        kind = [s for s in self.servers if s.prefill and s.up]
        if not kind:
            return
        server = kind[index % len(kind)]
        task = server.track(server.backend.prefill(prompt_ids))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.hang_timeout_s)
        finally:
            task.cancel()
        error = None if task.cancelled() or not done else task.exception()
        server.prefill_timeouts = 0 if done else server.prefill_timeouts + 1
        if isinstance(error, BackendError) and not error.client_error and not isinstance(error, MalformedResponse):
            await self.mark_down(server, f"prefill failed: {error}")
        elif not done or error is not None:
            why = f"no answer within {self.hang_timeout_s:g} s" if not done else f"{type(error).__name__}: {error}"
            self.log.emit("prefill_skipped", name=server.name, group=index, reason=why[:500])
            if server.prefill_timeouts >= PREFILL_TIMEOUTS:  # answers /metrics, never a prefill: restart it
                await self.mark_down(server, f"{PREFILL_TIMEOUTS} prefills in a row unanswered", hung=True)

    # ---- requests ----
    async def call(self, index: int, make: Callable[[InferenceBackend, Callable[[], None]], Awaitable], n: int = 1,
                   home: Home | None = None):
        """Run one request (n sequences) for group `index` on a server that is up (`pick`), re-issuing
        it on another server when the one it ran on went down under it; `home` learns where it ran.
        `make(backend, release)` issues it; `release()` frees one finished member's place on the server."""
        for _ in range(MAX_ATTEMPTS):
            server = await self.pick(index, home.server if home is not None else None, n)
            held = Held(server, n)
            task = server.track(make(server.backend, held.release))
            try:
                await asyncio.wait({task})
            finally:
                task.cancel()  # the group itself was cancelled (the run stops)
                held.release(held.n)
            if task.cancelled():  # its server went down: re-issue (a later turn: the conversation moves)
                self.log.emit("reissued", group=index, name=server.name,
                              later_turn=home is not None and home.server is not None)
                continue
            error = task.exception()
            if error is None:
                if home is not None:
                    home.server = server
                return task.result()
            if not isinstance(error, BackendError) or error.client_error or isinstance(error, MalformedResponse):
                raise error  # the request's fault or a protocol mismatch: another server would do the same
            await self.mark_down(server, f"request failed: {error}")
        raise BackendError(f"group {index}: failed on {MAX_ATTEMPTS} attempts on servers that kept failing")

    # ---- weights ----
    async def load_all(self, version: int) -> list[float]:
        """Load `version` on every server that is up; a server that fails to is taken out (it rejoins
        with the served version). A version a server rejects ends the run (the weights are bad)."""
        async with self.weights_lock:
            up = [s for s in self.servers if s.up]
            results = await asyncio.gather(*(s.track(s.backend.load_weights(version)) for s in up),
                                           return_exceptions=True)
            self.served = version
            paused = []
            for s, r in zip(up, results):
                if isinstance(r, WeightsRejected):
                    raise r
                if isinstance(r, asyncio.CancelledError):
                    continue  # went down meanwhile
                if isinstance(r, ServerStuck):
                    await self.mark_down(s, f"loading weights v{version}: {r}", stuck=True)
                elif isinstance(r, BackendError):
                    await self.mark_down(s, f"loading weights v{version} failed: {r}")
                elif isinstance(r, BaseException):
                    raise r
                else:
                    paused.append(r)
                    if s.backend.version > version:  # held a newer one (streamed first): serves that instead
                        self.log.emit("weights_skipped", name=s.name, asked=version, serves=s.backend.version)
            return paused

    # ---- watching ----
    async def watch(self, server: Server) -> None:
        """Every second: an up server's metrics (logged), or a down server's way back."""
        while True:
            if server.up:
                await self.check(server)
            else:
                await self.rejoin(server)
            await asyncio.sleep(1.0)

    async def check(self, server: Server) -> None:
        try:
            async with asyncio.timeout(self.hang_timeout_s):
                m = await server.backend.metrics()
        except TimeoutError:
            await self.mark_down(server, f"/metrics not answered for {self.hang_timeout_s:.0f}s", hung=True)
            return
        except BackendError as e:
            if e.client_error:
                raise
            await self.mark_down(server, f"not answering: {e}")
            return
        if m.version < self.served and server.up:  # restarted between two checks: fresh weights
            await self.mark_down(server, f"serves v{m.version}, not the served v{self.served} (restarted?)")
            return
        self.log.emit("server", name=server.name, **m.model_dump())
        self.on_metrics(server, m)
        async with self.changed:
            self.changed.notify_all()  # the in-flight budget may have grown

    async def report_final(self) -> None:
        """Each server's counters once more when the run is done (a short run may end between two
        checks); a server that does not answer now is left out."""
        for server in (s for s in self.servers if s.up):
            try:
                async with asyncio.timeout(self.hang_timeout_s):
                    m = await server.backend.metrics()
            except (BackendError, TimeoutError):
                continue
            self.log.emit("server", name=server.name, **m.model_dump())

    async def rejoin(self, server: Server) -> None:
        if time.monotonic() - server.down_since > max(self.startup_timeout_s, self.hang_timeout_s):
            server.down_since = time.monotonic()  # reported once per period: the driver restarts it
            self.log.emit("unresponsive", name=server.name,
                          cause=f"down and not back for {max(self.startup_timeout_s, self.hang_timeout_s):.0f}s")
        server.backend.reset()  # before wait_ready, which learns the new server's state
        try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel (the monitor then never ends)
            async with asyncio.timeout(self.hang_timeout_s):
                await server.backend.wait_ready(5.0)
        except (BackendError, TimeoutError):
            return  # still down (the driver is restarting it)
        t0 = time.perf_counter()
        async with self.weights_lock:
            if self.served >= 0:
                try:  # bounded: a server hung while loading must not hold the relay of new versions
                    async with asyncio.timeout(self.hang_timeout_s):
                        await server.backend.load_weights(self.served)
                except TimeoutError:
                    self.log.emit("unresponsive", name=server.name,
                                  cause=f"loading v{self.served} took over {self.hang_timeout_s:.0f}s")
                    return
                except BackendError as e:  # rejected too: the served version may have been pruned meanwhile
                    self.log.emit("server_state", name=server.name, state="down", cause=f"rejoin failed: {e}"[:300])
                    if isinstance(e, ServerStuck):
                        self.log.emit("unresponsive", name=server.name, cause=f"rejoin: {e}"[:300], stuck=True)
                    return
            server.up = True
        self.log.emit("server_state", name=server.name, state="up", version=self.served,
                      rejoin_s=round(time.perf_counter() - t0, 3))
        async with self.changed:
            self.changed.notify_all()

"""Servers of the run whose weights never change: a teacher's (`prl.orchestrator.teacher`) and a reward model's
(`prl.orchestrator.rewards`). A request goes to the next server in turn.

Rules:
- a server that fails a request is retried on the next one, for up to `retry_s` while the driver restarts it;
- one that does not answer within `hang_s` is reported hung once per process (an `unresponsive` event: the driver
  kills and restarts it; requests sent before the report belong to the killed one) and the request retried;
- a client error (4xx: the request itself is wrong) is not retried, but for 408 and 429 (a timeout, a rate limit),
  retried after 5 s;
- past `retry_s` the caller gets a BackendError naming the servers and the last failure.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from prl.backends.base import BackendError

T = TypeVar("T")
RETRIED = (408, 429)  # client errors sent again: the server timed out, or limits the rate


class FrozenServers:
    def __init__(self, kind: str, backends: list, retry_s: float, hang_s: float = 600.0,
                 on_hang: Callable[[int, str], None] = lambda index, cause: None):
        self.kind, self.backends, self.retry_s, self.hang_s, self.on_hang = kind, backends, retry_s, hang_s, on_hang
        self.turn = itertools.cycle(range(len(backends)))
        self.reported: dict[int, float] = {}  # server -> when it was last reported hung

    async def start(self, timeout: float) -> None:
        """Wait for the servers; none up after `timeout` is a BackendError."""
        results = await asyncio.gather(*(b.wait_ready(timeout) for b in self.backends), return_exceptions=True)
        if all(isinstance(r, BaseException) for r in results):
            raise BackendError(f"no {self.kind} server came up: {results[0]}")

    async def call(self, request: Callable[[object], Awaitable[T]]) -> T:
        """`request(backend)` on the next server in turn, retried across them while they come back."""
        deadline, error = time.monotonic() + self.retry_s, None
        while time.monotonic() < deadline:
            index, sent = next(self.turn), time.monotonic()
            try:
                async with asyncio.timeout(self.hang_s):
                    return await request(self.backends[index])
            except TimeoutError:
                where = getattr(self.backends[index], "base_url", "")
                error = BackendError(f"{self.kind}-{index} ({where}) did not answer for {self.hang_s:.0f} s")
                if sent > self.reported.get(index, float("-inf")):  # else: sent to the process already reported
                    self.reported[index] = time.monotonic()
                    self.on_hang(index, str(error))
            except BackendError as e:
                if e.client_error and e.status not in RETRIED:
                    raise
                error = e
                await asyncio.sleep(1.0 if e.status not in RETRIED else 5.0)
        raise BackendError(f"the {self.kind}'s servers failed for {self.retry_s:.0f} s: {error}")

    async def close(self) -> None:
        await asyncio.gather(*(b.close() for b in self.backends))

"""Async client of the trainer endpoint, used by the orchestrator.

Rule: the trainer endpoint may be not up yet (loading, warm start) or briefly unreachable (a
reconnect); every call retries transport errors and 5xx answers with backoff until its deadline.
A batch PUT is idempotent per step, so a retry after a lost reply is harmless. An endpoint that
accepts a connection but answers nothing within `hang_timeout_s` (its process stopped) is reported
once per outage through `on_hang`: the orchestrator tells the driver, which restarts the trainer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from prl.transport.batch import TrainBatch
from prl.transport.rollouts import batch_bytes


LOCATE_EVERY_S = 0.25  # how often a request waiting on the endpoint looks where it published it listens


class TrainerUnreachable(RuntimeError):
    pass


class TrainerClient:
    def __init__(self, base_url: str, secret: str, deadline_s: float = 600.0, hang_timeout_s: float = 120.0,
                 on_hang: Callable[[str], None] | None = None, locate: Callable[[], str] | None = None):
        """`locate`: where the endpoint listens now, asked again after a failed connection (a restarted
        trainer may have moved off a taken port)."""
        self.base_url, self.locate = base_url, locate
        self.deadline_s, self.hang_timeout_s, self.on_hang = deadline_s, hang_timeout_s, on_hang
        self.hung = False  # reported, until the endpoint answers again
        self.http = httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {secret}"},
                                      timeout=httpx.Timeout(hang_timeout_s, connect=10.0))

    async def close(self) -> None:
        await self.http.aclose()

    def retarget(self) -> bool:
        """Follow the endpoint to where it published that it listens, before every attempt: a listener
        on the configured port may be another process that accepts and never answers. True if it moved."""
        moved = self.locate() if self.locate else self.base_url
        if moved == self.base_url:
            return False
        self.base_url = self.http.base_url = moved
        return True

    async def _request(self, method: str, path: str, **kw) -> httpx.Response:
        deadline, delay, last = time.monotonic() + self.deadline_s, 0.1, ""
        while True:
            self.retarget()
            try:
                r = await self._attempt(method, path, **kw)
                if r is None:  # the endpoint published another place while this one said nothing: ask there
                    continue
                self.hung = False
                if r.status_code < 500:
                    r.raise_for_status()
                    return r
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
                if self.retarget():  # it moved: not a hang, ask there now
                    continue
                if isinstance(e, httpx.TimeoutException) and not self.hung and self.on_hang:
                    self.hung = True
                    self.on_hang(f"trainer endpoint {self.base_url}{path} answered nothing: {last}")
            if time.monotonic() > deadline:
                raise TrainerUnreachable(f"trainer endpoint {self.base_url}{path} failed for "
                                         f"{self.deadline_s:.0f}s; last error: {last}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _attempt(self, method: str, path: str, **kw) -> httpx.Response | None:
        """One request; None, the request dropped, if the endpoint publishes another place while it waits (the
        configured port may be held by a process that accepts and never answers until the trainer, which moved off
        it, publishes where it listens). Every request here may be sent again."""
        if self.locate is None:
            return await self.http.request(method, path, **kw)
        task = asyncio.ensure_future(self.http.request(method, path, **kw))
        try:
            while not (await asyncio.wait({task}, timeout=LOCATE_EVERY_S))[0]:
                if self.retarget():
                    return None
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def send_batch(self, batch: TrainBatch) -> None:
        data = batch_bytes(batch)
        await self._request("PUT", f"/rollouts/{batch.step}", content=data)

    async def finished(self) -> None:
        """Every batch shipped and every eval logged: a trainer waiting for it may exit."""
        await self._request("PUT", "/finished")

    async def resume_point(self) -> tuple[int, int, list[int]]:
        """(first step, data position, indices past it consumed already) the trainer starts from; waits
        while the trainer loads."""
        meta = (await self._request("GET", "/resume")).json()
        return meta["step"], meta["data_position"], meta.get("data_ahead", [])

    async def latest_version(self, after: int, wait_s: float | None = None) -> int:
        """The newest sealed version, long-polled for one newer than `after`. A stopped endpoint is told from a long
        poll only once the poll's own wait is past: by default half the hang timeout, at most 10 s (a hung trainer is
        reported within 1.5 x `hang_timeout_s`, or the timeout plus 10 s)."""
        wait_s = min(10.0, self.hang_timeout_s / 2) if wait_s is None else wait_s
        r = await self._request("GET", "/weights/latest", params={"after": after, "wait": wait_s},
                                timeout=wait_s + self.hang_timeout_s)
        return r.json()["version"]

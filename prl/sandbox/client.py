"""The orchestrator's side of the `sandbox` role: `await SandboxClient(urls, secret).run(code, ...)`
sends one execution to the worker with the fewest executions in flight from this client, and returns
its `Result`.

A worker that cannot be reached (dead, restarting, or moved to another port on this machine) is
skipped; the execution goes to another, or waits for one to come back, for up to `unavailable_s`,
after which `SandboxUnavailable` names the workers and the last error. An execution whose connection
broke is sent again (the worker cancels an execution whose client went away, and a program has no
effect outside its own sandbox, so repeating it is harmless). A 4xx answer is the request's own
fault and raises `ValueError` at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from prl.sandbox.result import Result, SandboxUnavailable

RETRY_S = 0.5
SLACK_S = 30.0  # a worker's answer may come this long after the program's own wall limit


class Worker:
    def __init__(self, url: str, locate: Callable[[], str] | None, concurrency: int):
        self.url, self.locate = url, locate
        self.slots = asyncio.Semaphore(concurrency)  # sent only when the worker can start it at once
        self.in_flight = 0  # sent or waiting for a slot
        self.down_until = 0.0  # monotonic time before which it is not tried again

    def address(self) -> str:
        return self.locate() if self.locate is not None else self.url


class SandboxClient:
    def __init__(self, urls: list[str], secret: str, concurrency: int, execution_timeout_s: float,
                 unavailable_s: float = 120.0, locate: Callable[[int, str], str] | None = None,
                 on_hang: Callable[[int, str], None] | None = None, slack_s: float = SLACK_S):
        """`concurrency`: executions each worker runs at once (more wait here, not in its queue);
        `execution_timeout_s`: the workers' wall limit, so a worker that has not answered
        `SLACK_S` after it is taken for hung; `locate(i, url)`: where worker i listens now (on one
        machine a restarted worker may bind another port), None on a cluster (ports configured);
        `on_hang(i, cause)`: worker i took a program and did not answer in time (the orchestrator
        reports it, and the driver restarts the worker)."""
        if not urls:
            raise ValueError("SandboxClient needs at least one sandbox worker URL")
        self.workers = [Worker(u, (lambda i=i, u=u: locate(i, u)) if locate else None, concurrency)
                        for i, u in enumerate(urls)]
        self.unavailable_s, self.on_hang = unavailable_s, on_hang
        self.answer_s = execution_timeout_s + slack_s
        self.http = httpx.AsyncClient(headers={"Authorization": f"Bearer {secret}"},
                                      timeout=httpx.Timeout(self.answer_s, connect=5.0))

    def pick(self) -> Worker | None:
        now = time.monotonic()
        up = [w for w in self.workers if w.down_until <= now]
        return min(up, key=lambda w: w.in_flight) if up else None

    async def run(self, code: str, *, language: str = "python", stdin: str | None = None,
                  files: dict[str, str] | None = None, args: list[str] = ()) -> Result:
        body = {"code": code, "language": language, "stdin": stdin, "files": files or {}, "args": list(args)}
        give_up, last = time.monotonic() + self.unavailable_s, "no worker tried yet"
        while time.monotonic() < give_up:
            w = self.pick()
            if w is None:
                await asyncio.sleep(RETRY_S)
                continue
            try:
                return await self.send(w, body)
            except (httpx.TransportError, ServerFault) as e:
                last = f"{w.address()}: {type(e).__name__}: {e}"
                w.down_until = time.monotonic() + RETRY_S
                if isinstance(e, httpx.ReadTimeout) and self.on_hang is not None:
                    self.on_hang(self.workers.index(w), f"no answer {self.answer_s:.0f}s after it took a program")
        names = ", ".join(w.address() for w in self.workers)
        raise SandboxUnavailable(f"no sandbox worker ran the program within {self.unavailable_s:.0f}s "
                                 f"(workers: {names}; last error: {last})")

    async def send(self, w: Worker, body: dict) -> Result:
        w.in_flight += 1
        try:
            async with w.slots:
                r = await self.http.post(f"{w.address()}/run", json=body)
        finally:
            w.in_flight -= 1
        if 400 <= r.status_code < 500:
            raise ValueError(f"sandbox worker {w.address()} refused the program ({r.status_code}): {r.text[:300]}")
        if r.status_code != 200:
            raise ServerFault(f"answered {r.status_code}: {r.text[:300]}")
        return Result(**r.json())

    async def health(self) -> list[dict]:
        out = []
        for w in self.workers:
            r = await self.http.get(f"{w.address()}/health")
            r.raise_for_status()
            out.append(r.json())
        return out

    async def close(self) -> None:
        await self.http.aclose()


class ServerFault(RuntimeError):
    """A worker answered 5xx: it failed, not the program; another worker may run it."""

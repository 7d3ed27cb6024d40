"""`EngineLoop`: runs an `EngineCore` on its own thread and bridges it to asyncio callers.

Rule: only the engine thread touches the model. Callers submit sequences, staged weights and jobs (`run`: a
function of the core, e.g. scoring tokens, between two steps); pausing stops decoding and jobs but still applies
staged weights, so pause -> update -> resume works.
If a step raises, every waiting caller gets the error and `failed` is set.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable

from prl.inference.engine import EngineCore, Sequence


class EngineLoop:
    def __init__(self, core: EngineCore, on_failure=None):
        self.core = core
        self.on_failure = on_failure
        self.paused = False
        self.failed: str | None = None
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._futures: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._jobs: deque[tuple[Callable, asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        # starts with the engine's own start, so the first poll is a measured rate, not 0 by construction
        self._rate: deque[tuple[float, int]] = deque([(time.monotonic(), core.stats.generated_tokens)], maxlen=64)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    async def generate(self, seq: Sequence) -> Sequence:
        if self.failed:
            raise RuntimeError(f"engine failed: {self.failed}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._futures[seq.id] = (loop, fut)
        seq.on_done = self._resolve
        self.core.add(seq)
        self._notify()
        try:
            return await fut
        except asyncio.CancelledError:  # the caller went away: free its slot in the batch
            self.core.abort(seq)
            self._futures.pop(seq.id, None)
            self._notify()
            raise

    async def run(self, job: Callable):
        """`job(core)` on the engine thread between two steps; what it raises is the caller's, not the engine's."""
        if self.failed:
            raise RuntimeError(f"engine failed: {self.failed}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cond:
            self._jobs.append((job, loop, fut))
            self._cond.notify_all()
        return await fut

    def _run_jobs(self) -> None:
        while self._jobs:
            job, loop, fut = self._jobs.popleft()
            if fut.cancelled():
                continue
            try:
                result, error = job(self.core), None
            except Exception as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            loop.call_soon_threadsafe(lambda f=fut, r=result, e=error: f.done() or (
                f.set_exception(e) if e is not None else f.set_result(r)))

    async def load(self, policy) -> None:
        done = self.core.stage_weights(policy)
        self._notify()
        await asyncio.to_thread(done.wait)

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self._notify()

    def tokens_per_s(self) -> float:
        now, total = time.monotonic(), self.core.stats.generated_tokens
        self._rate.append((now, total))
        while len(self._rate) > 2 and now - self._rate[0][0] > 10:
            self._rate.popleft()
        t0, n0 = self._rate[0]
        return (total - n0) / (now - t0) if now > t0 else 0.0

    def _resolve(self, seq: Sequence) -> None:
        if seq.id not in self._futures:  # aborted: nobody waits for it
            return
        loop, fut = self._futures.pop(seq.id)
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(seq))

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            while self._wait_for_work():
                if self.paused:
                    self.core.apply_staged()
                    continue
                self.core.apply_staged()  # a job scores under the version the next step serves
                self._run_jobs()
                if self.core.has_work():
                    self.core.step()
        except Exception:  # noqa: BLE001 - reported to every caller, then the server exits
            self.failed = traceback.format_exc()
            print(self.failed, flush=True)
            for loop, fut in [*self._futures.values(), *((lp, f) for _, lp, f in self._jobs)]:
                loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_exception(RuntimeError("engine failed")))
            if self.on_failure:
                self.on_failure()

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._stopping and not self._has_work():
                self._cond.wait(0.5)
            return not self._stopping

    def _has_work(self) -> bool:
        if self.paused:
            return self.core.has_staged()
        return self.core.has_work() or bool(self._jobs)

"""An asyncio front to the sandbox: executions run in worker threads, at most `concurrency` at once,
so a hung program costs one worker until its wall timeout and never blocks the event loop."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from prl.sandbox import isolation as iso
from prl.sandbox.result import Result
from prl.sandbox.runner import run


class SandboxPool:
    """`await pool.run(code, **kwargs)` runs `prl.sandbox.run(code, **defaults, **kwargs)` in a worker.

    Each worker blocks in its execution (a sandboxed subprocess watched with select), so threads
    are enough: no GIL-bound work happens there. Every execution ends by its own wall timeout (or
    when its awaiting task is cancelled), so a worker is never lost. `counts` holds executions and
    stop reasons for the metrics; `in_flight` and `peak_in_flight` the concurrency."""

    def __init__(self, concurrency: int = 4, **defaults):
        if concurrency < 1:
            raise ValueError(f"SandboxPool concurrency must be at least 1, got {concurrency}")
        iso.check(defaults.get("isolation", "namespaces"))  # refuse at construction, not mid-rollout
        self.concurrency = concurrency
        self.defaults = defaults
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="prl-sandbox")
        self._lock = threading.Lock()
        self.in_flight = 0
        self.peak_in_flight = 0
        self.counts: Counter = Counter()

    @classmethod
    def from_config(cls, cfg) -> "SandboxPool":
        """The pool a recipe's `[env.sandbox]` (`prl.recipe.schema.SandboxCfg`) describes."""
        return cls(concurrency=cfg.concurrency, isolation=cfg.isolation, timeout_s=cfg.timeout_s,
                   memory_mb=cfg.memory_mb, max_procs=cfg.max_procs, max_output_bytes=cfg.max_output_bytes)

    async def run(self, code_or_file, **kwargs) -> Result:
        """Run one program in the sandbox without blocking the event loop; see `prl.sandbox.run`.
        Cancelling the awaiting task stops the execution (killed_reason "cancelled" in `counts`)."""
        cancel = threading.Event()
        call = functools.partial(self._run, code_or_file, {**self.defaults, **kwargs, "cancel": cancel})
        future = asyncio.get_running_loop().run_in_executor(self._executor, call)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            cancel.set()
            raise

    def _run(self, code_or_file, kwargs: dict) -> Optional[Result]:
        if kwargs["cancel"].is_set():  # cancelled while queued: nobody awaits it any more
            return None
        with self._lock:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            result = run(code_or_file, **kwargs)
        finally:
            with self._lock:
                self.in_flight -= 1
        with self._lock:
            self.counts["executions"] += 1
            if result.killed_reason:
                self.counts[f"killed.{result.killed_reason}"] += 1
        return result

    def close(self, wait: bool = True) -> None:
        """Stop taking executions; with `wait`, return once the running ones have ended."""
        self._executor.shutdown(wait=wait, cancel_futures=True)

    async def __aenter__(self) -> "SandboxPool":
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

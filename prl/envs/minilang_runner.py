"""How minilang programs reach the sandbox (`prl.envs.code_env`): the harness (`prl.envs.minilang`)
interprets them, so a program is data there and its outcome a function of (target, program). Hence:

- a program already run on the same target is answered from a bounded cache (`cached`), and copies of
  one that is running wait for its answer instead of running again (a group's members often write the
  same program at the same moment);
- programs that arrive within `window_s` of each other (a group's members, every group in flight) share
  one sandbox execution of the harness in batch mode, up to `max_batch`: sharing an execution shares
  nothing a program could reach. Each gets its own `Result` (its answer, exit code, and share of the
  time). A batch the sandbox stopped (timeout, output cap) or answered short or unreadably runs again
  program by program, so one bad batch never decides another program's outcome.
Timeouts and kills are outcomes of the machine's load, never cached.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import OrderedDict
from pathlib import Path

HARNESS = (Path(__file__).parent / "minilang.py").read_text()


class MinilangRunner:
    def __init__(self, sandbox, window_s: float = 0.005, max_batch: int = 32, cache_size: int = 4096):
        self.sandbox, self.window_s, self.max_batch, self.cache_size = sandbox, window_s, max_batch, cache_size
        self.cache: OrderedDict = OrderedDict()
        self.running: dict[tuple[str, str], asyncio.Future] = {}
        self.pending: list[tuple[str, str, asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tasks: set[asyncio.Task] = set()
        self.runs = 0  # sandbox executions (a batch is one)

    async def run(self, target: str, program: str):
        """(result, from_cache) for one program."""
        key = (target, program.strip())
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key], True
        if key in self.running:
            return await asyncio.shield(self.running[key]), True
        fut = self.running[key] = asyncio.get_running_loop().create_future()
        try:
            result = await self.batched(*key)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: the copies waiting on it get it; none waiting is no error
            raise
        finally:
            self.running.pop(key, None)
        fut.set_result(result)
        if not (result.timed_out or result.killed_reason):
            self.cache[key] = result
            if len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return result, False

    # ---- batching ----
    async def batched(self, target: str, program: str):
        loop = asyncio.get_running_loop()
        if self.loop is not loop:  # a new event loop (tests run several): nothing pending belongs to it
            self.loop, self.pending, self.timer = loop, [], None
        fut = loop.create_future()
        self.pending.append((target, program, fut))
        if len(self.pending) >= self.max_batch:
            self.flush()
        elif self.timer is None:
            self.timer = loop.call_later(self.window_s, self.flush)
        return await fut

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.pending = self.pending, []
        if batch:
            task = asyncio.ensure_future(self.execute(batch))
            self.tasks.add(task)  # kept until done: the loop holds tasks weakly
            task.add_done_callback(self.tasks.discard)

    async def execute(self, batch) -> None:
        try:
            outcomes = await self.answers([(t, p) for t, p, _ in batch])
        except asyncio.CancelledError:
            for *_, fut in batch:
                fut.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - the sandbox itself failed (no worker): every program gets it
            outcomes = [e] * len(batch)
        for (*_, fut), outcome in zip(batch, outcomes):
            if fut.done():
                continue
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)

    async def answers(self, items: list[tuple[str, str]]) -> list:
        """One outcome (a Result, or the exception its run raised) per program."""
        if len(items) > 1:
            stdin = "#batch\n" + "\n".join(json.dumps({"target": t, "program": p}) for t, p in items)
            res = await self.sandbox.run(HARNESS, language="python", stdin=stdin)
            self.runs += 1
            split = self.split(res, len(items))
            if split is not None:
                return split
        return list(await asyncio.gather(*(self.one(t, p) for t, p in items), return_exceptions=True))

    @staticmethod
    def split(res, n: int):
        """The batch's result as n programs' results, or None when it cannot be read as n answers."""
        lines = res.stdout.splitlines()
        if not res.ok or len(lines) != n:
            return None
        try:
            answers = [json.loads(line) for line in lines]
            return [dataclasses.replace(res, exit_code=int(a["code"]), stdout=str(a["out"]) + "\n",
                                        wall_s=res.wall_s / n, cpu_s=res.cpu_s / n) for a in answers]
        except (ValueError, TypeError, KeyError):
            return None

    async def one(self, target: str, program: str):
        self.runs += 1
        return await self.sandbox.run(HARNESS, language="python", stdin=f"{target}\n{program}")

"""Turns of code execution: the model writes a program, prl runs it in the sandbox (`prl.sandbox`,
a pool of workers so a hung program never blocks generation), and its outcome (exit code, output,
errors, capped) comes back as the next turn's environment tokens; the episode ends when a program
passes or at a limit. The reward comes from the final state: 1 for a passing program (less
`env.attempt_penalty` for each failed attempt before it), else `env.fail_credit` (default half) times
the similarity of its output to the target (a program that cannot run: 0).

Languages: `minilang` (prl's tiny language, `prl.envs.minilang`, for the tiny models; its harness
prints `ok` or `got:... want:...` as a test runner would; its outcome is a function of the target and
the program, so a program already run on the same target is answered from `ResultCache`, counted as
`sandbox_cached`, and every distinct program still runs in the sandbox once; programs arriving together
share one sandbox execution, `MinilangBatcher`) and `python` (a Hugging Face model's
```python block or its whole answer; it passes when its stdout, stripped, is the example's answer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
from collections import OrderedDict
from pathlib import Path

from prl.envs.multi_turn import Episode, MultiTurnEnv
from prl.envs.tools import cap
from prl.tasks.builtin import edit_similarity

HARNESS = (Path(__file__).parent / "minilang.py").read_text()


class LazySandbox:
    """The recipe's sandbox pool, made on first use: a process that only asks for demonstrations
    (the trainer's warm start) never needs one."""

    def __init__(self, cfg):
        self.cfg, self.pool = cfg, None

    async def run(self, code, **kw):
        if self.pool is None:
            from prl.sandbox import SandboxPool

            self.pool = SandboxPool.from_config(self.cfg)
        return await self.pool.run(code, **kw)
class MinilangBatcher:
    """minilang programs that arrive within `window_s` of each other (a group's members, every group in
    flight) share one sandbox execution of the harness in batch mode, up to `max_batch` programs: the
    programs are data to prl's interpreter, so sharing an execution shares nothing a program could
    reach. Each program gets its own `Result` (its answer, its exit code, its share of the wall time);
    a batch the sandbox stopped (timeout, output cap) or answered short is run again one program at a
    time, so one bad batch never decides another program's outcome."""

    def __init__(self, sandbox, window_s: float = 0.005, max_batch: int = 32):
        self.sandbox, self.window_s, self.max_batch = sandbox, window_s, max_batch
        self.pending: list[tuple[str, str, asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.runs = 0  # sandbox executions (each a batch)

    async def run(self, target: str, program: str):
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((target, program, fut))
        if len(self.pending) >= self.max_batch:
            self.flush()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.window_s, self.flush)
        return await fut

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.pending = self.pending, []
        if batch:
            asyncio.ensure_future(self.execute(batch))

    async def execute(self, batch) -> None:
        try:
            results = await self.answers([(t, p) for t, p, _ in batch])
        except BaseException as e:  # noqa: BLE001 - every waiting program gets the error (no worker, cancelled)
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (*_, fut), result in zip(batch, results):
            if not fut.done():
                fut.set_result(result)

    async def answers(self, items: list[tuple[str, str]]) -> list:
        if len(items) == 1:
            return [await self.one(*items[0])]
        stdin = "#batch\n" + "\n".join(json.dumps({"target": t, "program": p.strip()}) for t, p in items)
        res = await self.sandbox.run(HARNESS, language="python", stdin=stdin)
        self.runs += 1
        lines = res.stdout.splitlines()
        if not res.ok or len(lines) != len(items):
            return [await self.one(t, p) for t, p in items]
        share = res.wall_s / len(items)
        out = []
        for line in lines:
            answer = json.loads(line)
            out.append(dataclasses.replace(res, exit_code=int(answer["code"]), stdout=str(answer["out"]) + "\n",
                                           wall_s=share, cpu_s=res.cpu_s / len(items)))
        return out

    async def one(self, target: str, program: str):
        self.runs += 1
        return await self.sandbox.run(HARNESS, language="python", stdin=f"{target}\n{program.strip()}")


class ResultCache:
    """The last `size` outcomes of a deterministic harness, by (target, program)."""

    def __init__(self, size: int = 4096):
        self.size, self.items = size, OrderedDict()

    def get(self, key):
        hit = self.items.get(key)
        if hit is not None:
            self.items.move_to_end(key)
        return hit

    def put(self, key, result) -> None:
        if result.timed_out or result.killed_reason:
            return  # an outcome of the machine's load, not of the program
        self.items[key] = result
        if len(self.items) > self.size:
            self.items.popitem(last=False)


FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)


def mistake(answer: str, rng: random.Random) -> str:
    """A wrong output near `answer`: a letter dropped, doubled or changed, two neighbours swapped, or
    the letters shuffled; never the answer itself."""
    letters = sorted(set(answer)) + ["a", "e", "z"]
    for _ in range(20):
        i = rng.randrange(len(answer))
        kind = rng.choice(["drop", "double", "change", "swap", "shuffle"])
        if kind == "drop" and len(answer) > 1:
            wrong = answer[:i] + answer[i + 1:]
        elif kind == "double":
            wrong = answer[:i + 1] + answer[i:]
        elif kind == "change":
            wrong = answer[:i] + rng.choice(letters) + answer[i + 1:]
        elif kind == "swap" and i + 1 < len(answer):
            wrong = answer[:i] + answer[i + 1] + answer[i] + answer[i + 2:]
        else:
            wrong = "".join(rng.sample(answer, len(answer)))
        if wrong and wrong != answer:
            return wrong
    return answer + answer[-1]


class CodeEnv(MultiTurnEnv):
    def __init__(self, sandbox, language: str, max_env_chars: int, attempt_penalty: float = 0.0,
                 fail_credit: float = 0.5, **kw):
        super().__init__(**kw)
        self.sandbox, self.language, self.max_env_chars = sandbox, language, max_env_chars
        self.attempt_penalty, self.fail_credit = attempt_penalty, fail_credit
        self.cache = ResultCache() if language == "minilang" else None
        self.batcher = MinilangBatcher(sandbox) if language == "minilang" else None

    async def respond(self, ep: Episode, text: str, example: dict) -> list[int] | None:
        key = (example["answer"], text.strip())
        result = self.cache.get(key) if self.cache is not None else None
        if result is not None:
            ep.stats["cached"] += 1
        else:
            result = await self.execute(text, example)
            ep.stats["executions"] += 1
            ep.stats["sandbox_s"] += result.wall_s
            if self.cache is not None:
                self.cache.put(key, result)
        if result.timed_out:
            ep.stats["timeouts"] += 1
        elif result.killed_reason:
            ep.stats["kills"] += 1
        passed = self.passed(result, example)
        ep.attempts.append(passed)
        ep.last_output = result.stdout.strip()
        ep.outputs.append(ep.last_output)
        if passed:
            return None
        ep.replies.append(self.feedback(result))
        return self.fmt.reply_ids("feedback", ep.replies[-1])

    async def execute(self, text: str, example: dict):
        if self.language == "minilang":
            return await self.batcher.run(example["answer"], text)
        m = FENCE.search(text)
        return await self.sandbox.run(m.group(1) if m else text, language="python")

    def passed(self, result, example: dict) -> bool:
        if self.language == "minilang":
            return result.exit_code == 0 and result.stdout.strip() == "ok"
        return result.exit_code == 0 and result.stdout.strip() == example["answer"]

    def feedback(self, result) -> str:
        if self.language == "minilang":
            out = result.stdout.strip() or ("err:timeout" if result.timed_out else "err:no output")
            return cap(out, self.max_env_chars)
        why = f" ({result.killed_reason})" if result.killed_reason else ""
        return cap(f"exit code {result.exit_code}{why}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}",
                   self.max_env_chars)

    def demonstration(self, index: int):
        """A passing program; for half the examples first a failing one (context only, not learned),
        the harness's real feedback on it, then the fix. The failing one makes a mistake of the kind
        a model makes (`mistake`), so the fix is learned in the contexts RL will meet."""
        example, rng = self.task.example(index), random.Random(index)
        ep = Episode(self.prompt_ids(example))
        answer = example["answer"]
        if rng.random() < 0.5:
            wrong = mistake(answer, rng)
            self.model_turn(ep, self.program(wrong), learn=False)
            self.env_turn(ep, self.fmt.reply_ids("feedback", self.expected_feedback(wrong, answer)))
        self.model_turn(ep, self.program(answer))
        return self.demo(ep)

    def program(self, output: str) -> str:
        return f"p {output}" if self.language == "minilang" else f"```python\nprint({output!r})\n```"

    def expected_feedback(self, printed: str, answer: str) -> str:
        """What running `program(printed)` answers (computed here: it is prl's own program, not the
        model's)."""
        if self.language == "minilang":
            return f"got:{printed} want:{answer}"
        return f"exit code 0\nstdout:\n{printed}\n\nstderr:\n"

    def score(self, ep: Episode, example: dict) -> float:
        if not ep.attempts:
            return 0.0
        return self.attempt_score(len(ep.attempts), ep.attempts[-1], ep.last_output, example)

    def attempt_score(self, k: int, passed: bool, output: str, example: dict) -> float:
        """The episode's score had it ended at attempt k (1-based) with this outcome."""
        if passed:
            return 1.0 - self.attempt_penalty * (k - 1)
        got = output.split(" want:")[0].removeprefix("got:") if self.language == "minilang" else output
        if not got or got.startswith("err:"):
            return 0.0
        return self.fail_credit * edit_similarity(got, example)

    def turn_rewards(self, ep: Episode, example: dict) -> list[float]:
        """Each attempt's own outcome (the credit of `rl.credit = "turn"`)."""
        return [self.attempt_score(k, passed, out, example)
                for k, (passed, out) in enumerate(zip(ep.attempts, ep.outputs), 1)]


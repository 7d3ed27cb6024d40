"""Turns of code execution: the model writes a program, prl runs it in the sandbox (`prl.sandbox`,
a pool of workers so a hung program never blocks generation), and its outcome (exit code, output,
errors, capped) comes back as the next turn's environment tokens; the episode ends when a program
passes or at a limit. The reward comes from the final state: 1 for a passing program (less
`env.attempt_penalty` for each failed attempt before it), else `env.fail_credit` (default half) times
the similarity of its output to the target (a program that cannot run: 0).

Languages: `minilang` (prl's tiny language, `prl.envs.minilang`, for the tiny models; its harness
prints `ok` or `got:... want:...` as a test runner would; its outcome is a function of the target and
the program: `prl.envs.minilang_runner` answers repeats from a cache, counted as `sandbox_cached`, and
runs programs arriving together in one sandbox execution) and `python` (a Hugging Face model's
```python block or its whole answer; it passes when its stdout, stripped, is the example's answer).
"""

from __future__ import annotations

import random
import re

from prl.envs.base import EnvContext
from prl.envs.minilang_runner import MinilangRunner
from prl.envs.multi_turn import Episode, MultiTurnEnv
from prl.envs.tools import cap
from prl.tasks.builtin import edit_similarity


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


FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)


def mistake(answer: str, rng: random.Random) -> str:
    """A wrong output near `answer`: a letter dropped, doubled or changed, two neighbours swapped, or
    the letters shuffled; never the answer itself."""
    if not answer:
        return "a"
    letters = sorted(set(answer)) + ["a", "e", "z"]
    for _ in range(20):
        i = rng.randrange(len(answer))
        kind = rng.choice(["drop", "double", "change", "swap", "shuffle"])
        if kind == "drop":
            wrong = answer[:i] + answer[i + 1:]
        elif kind == "double":
            wrong = answer[:i + 1] + answer[i:]
        elif kind == "change":
            wrong = answer[:i] + rng.choice(letters) + answer[i + 1:]
        elif kind == "swap":
            if i + 1 >= len(answer):
                continue
            wrong = answer[:i] + answer[i + 1] + answer[i] + answer[i + 2:]
        else:
            wrong = "".join(rng.sample(answer, len(answer)))
        if wrong and wrong != answer:
            return wrong
    return answer + answer[-1]


class CodeEnv(MultiTurnEnv):
    needs_sandbox = True

    def __init__(self, sandbox, language: str, max_env_chars: int, attempt_penalty: float = 0.0,
                 fail_credit: float = 0.5, **kw):
        super().__init__(**kw)
        self.sandbox, self.language, self.max_env_chars = sandbox, language, max_env_chars
        self.attempt_penalty, self.fail_credit = attempt_penalty, fail_credit
        self.minilang = MinilangRunner(sandbox) if language == "minilang" else None

    @classmethod
    def from_context(cls, ctx: EnvContext) -> "CodeEnv":
        env = ctx.cfg
        return cls(ctx.sandbox, env.language, env.max_env_chars, env.attempt_penalty, env.fail_credit,
                   **cls.context_args(ctx))

    async def respond(self, ep: Episode, text: str, example: dict) -> list[int] | None:
        result, cached = await self.execute(text, example)
        if cached:
            ep.stats["cached"] += 1
        else:
            ep.stats["executions"] += 1
            ep.stats["sandbox_s"] += result.wall_s
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
        """(result, answered from the cache)."""
        if self.minilang is not None:
            return await self.minilang.run(example["answer"], text)
        m = FENCE.search(text)
        return await self.sandbox.run(m.group(1) if m else text, language="python"), False

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
            return max(0.0, 1.0 - self.attempt_penalty * (k - 1))  # a reward stays in [0, 1] past 5 attempts
        got = output.split(" want:")[0].removeprefix("got:") if self.language == "minilang" else output
        if not got or got.startswith("err:"):
            return 0.0
        return self.fail_credit * edit_similarity(got, example)

    def turn_rewards(self, ep: Episode, example: dict) -> list[float]:
        """Each attempt's own outcome (the credit of `rl.credit = "turn"`)."""
        return [self.attempt_score(k, passed, out, example)
                for k, (passed, out) in enumerate(zip(ep.attempts, ep.outputs), 1)]


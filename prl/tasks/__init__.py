"""Tasks: a dataset function (index -> {"prompt", "answer", ...}) and a reward function
(completion text, example -> float in [0, 1], or (reward, answer)). Built-ins by name, reasoning-gym's
tasks as `reasoning_gym:<name>` (`prl.tasks.reasoning_gym`), user tasks by `module:function`, dataset
files (`task.data`, `prl.tasks.files`) and answer checkers by name (`prl.tasks.checkers`)."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable

from prl.tasks.builtin import BUILTIN
from prl.usercode import UserCodeError

WARM_START_SEED_OFFSET = 7919  # the warm start's demonstrations are drawn from run.seed + this, apart from RL's


@dataclass(frozen=True)
class Task:
    dataset_fn: Callable[..., dict]
    reward_fn: Callable[[str, dict], float | tuple]
    seed: int
    min_len: int
    max_len: int
    chat_template: bool | str = "auto"  # task.chat_template (prl.tasks.prompts)
    system_prompt: str | None = None
    max_prompt_tokens: int | None = None  # a dataset file's: longer prompts are skipped
    # task.options, as keyword arguments of the user's own dataset and reward functions
    dataset_options: dict = field(default_factory=dict, hash=False)
    reward_options: dict = field(default_factory=dict, hash=False)

    def example(self, index: int) -> dict:
        out = self.dataset_fn(index=index, seed=self.seed, min_len=self.min_len, max_len=self.max_len,
                              **self.dataset_options)
        if not isinstance(out, dict) or "prompt" not in out:  # checked where it crosses into prl
            got = f"a dict with keys {list(out)[:6]}" if isinstance(out, dict) else f"a {type(out).__name__}"
            raise UserCodeError(f"task.dataset {function_name(self.dataset_fn)} returned {got}; it returns a dict with "
                                f"\"prompt\" (and \"answer\" for a checker)")
        return out

    def score(self, completion: str, example: dict) -> tuple[float, str | None]:
        """The reward and the answer the completion gives, which maj@k votes on: a checker's (or a function's
        returning (reward, answer)) extracted answer, "" where it found none; None where the function returns a
        bare reward (the environment then votes on the text). What the function returns is checked here, where it
        crosses into prl: a UserCodeError naming it otherwise."""
        out = self.reward_fn(completion, example, **self.reward_options)
        who = f"task.reward {function_name(self.reward_fn)}"
        if isinstance(out, tuple):
            if len(out) != 2:
                raise UserCodeError(f"{who}: returns a float or (reward, answer), got a {len(out)}-tuple")
            return users_reward(out[0], who), "" if out[1] is None else str(out[1])
        return users_reward(out, who), None

    def reward(self, completion: str, example: dict) -> float:
        return self.score(completion, example)[0]

    def prompt_ids(self, tokenizer, prompt) -> list[int]:
        """The prompt's token ids, rendered as the recipe says (`prl.tasks.prompts`)."""
        from prl.tasks.prompts import prompt_ids

        return prompt_ids(tokenizer, prompt, self.chat_template, self.system_prompt)


def checked_reward(value) -> float:
    """A reward as a float in [0, 1]; a TypeError or ValueError saying what came back otherwise (a string "1" or a
    5.0 would train silently)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and type(value).__name__ not in FLOATS:
        raise TypeError(f"the reward is a {type(value).__name__} ({value!r:.40}): return a float in [0, 1]")
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"the reward is {value}, outside [0, 1]: scale it into [0, 1]")
    return value


FLOATS = ("float32", "float64", "float16", "int32", "int64")  # numpy scalars a reward may return


def users_reward(value, who: str) -> float:
    """`checked_reward` of what the user's function `who` returned: a UserCodeError naming it otherwise."""
    try:
        return checked_reward(value)
    except (TypeError, ValueError) as e:
        raise UserCodeError(f"{who}: {e}") from None


def function_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def import_function(spec: str, key: str) -> Callable:
    """The function `spec` ("module:function") names; a ValueError naming `key` when it cannot be used."""
    module_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except ModuleNotFoundError as e:
        if e.name == module_name or module_name.startswith(f"{e.name}."):
            raise ValueError(f"{key} = {spec!r}: cannot import: no module named {module_name!r} (run prl from the "
                             f"folder that holds {module_name.replace('.', '/')}.py, or add that folder to PYTHONPATH)"
                             ) from None
        raise ValueError(f"{key} = {spec!r}: cannot import ({type(e).__name__}: {e})") from None
    except Exception as e:  # noqa: BLE001 - whatever the user's module raises on import, in one line
        raise ValueError(f"{key} = {spec!r}: cannot import ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise ValueError(f"{key} = {spec!r}: not a function")
    if inspect.iscoroutinefunction(inspect.unwrap(fn)) or inspect.isasyncgenfunction(inspect.unwrap(fn)):
        raise ValueError(f"{key} = {spec!r}: an async function; prl calls it as a plain function (drop `async`)")
    return fn


def make_task(cfg, seed: int) -> Task:
    """The recipe's task (`cfg`: its `prl.recipe.schema.TaskCfg`); a ValueError naming the key when a function,
    a reasoning-gym task, a data file or its options cannot be used (`prl run` turns it into a refusal before
    anything starts)."""
    dataset, reward = BUILTIN.get(cfg.name, (None, None))
    if cfg.name.startswith("reasoning_gym:"):
        from prl.tasks.reasoning_gym import reasoning_gym_task

        dataset, reward = reasoning_gym_task(cfg.name.partition(":")[2], cfg.options)
    if cfg.dataset:
        dataset = import_function(cfg.dataset, "task.dataset")
    if cfg.data is not None:
        from prl.tasks.files import file_dataset

        dataset = file_dataset(cfg)
    if cfg.reward:
        reward = checker(cfg.reward) or import_function(cfg.reward, "task.reward")
    mine = not cfg.name.startswith("reasoning_gym:")  # reasoning-gym's take task.options themselves
    dataset_options = options_for(cfg.options, "task.dataset", dataset, ("index", "seed", "min_len", "max_len")) \
        if mine and cfg.dataset else {}
    reward_options = options_for(cfg.options, "task.reward", reward, ("completion", "example")) \
        if mine and cfg.reward and checker(cfg.reward) is None else {}
    return Task(dataset, reward, seed, cfg.min_len, cfg.max_len, cfg.chat_template, cfg.system_prompt,
                cfg.max_prompt_tokens if cfg.data is not None else None, dataset_options, reward_options)


def options_for(options: dict, key: str, fn: Callable, positional: tuple[str, ...]) -> dict:
    """task.options as keyword arguments of the user's function at `key`; a ValueError naming the option it
    does not take."""
    if not options:
        return {}
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return dict(options)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return dict(options)
    missing = [k for k in options if k not in sig.parameters or k in positional]
    if missing:
        raise ValueError(f"task.options {missing[0]!r}: {key} {function_name(fn)} takes no such keyword argument "
                         f"(add it, or **options, to its parameters)")
    return dict(options)


def checker(name: str) -> Callable | None:
    """The built-in answer checker `name` (exact, math, choice), or None."""
    from prl.tasks.checkers import CHECKERS

    return CHECKERS.get(name)

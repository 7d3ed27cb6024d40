"""Tasks: a dataset function (index -> {"prompt", "answer", ...}) and a reward function
(completion text, example -> float in [0, 1]). Built-ins by name, reasoning-gym's tasks as
`reasoning_gym:<name>` (`prl.tasks.reasoning_gym`), user tasks by `module:function`."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from prl.tasks.builtin import BUILTIN

WARM_START_SEED_OFFSET = 7919  # the warm start's demonstrations are drawn from run.seed + this, apart from RL's


@dataclass(frozen=True)
class Task:
    dataset_fn: Callable[..., dict]
    reward_fn: Callable[[str, dict], float]
    seed: int
    min_len: int
    max_len: int

    def example(self, index: int) -> dict:
        return self.dataset_fn(index=index, seed=self.seed, min_len=self.min_len, max_len=self.max_len)

    def reward(self, completion: str, example: dict) -> float:
        return float(self.reward_fn(completion, example))


def import_function(spec: str, key: str) -> Callable:
    """The function `spec` ("module:function") names; a ValueError naming `key` when it cannot be used."""
    module_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except Exception as e:  # noqa: BLE001 - whatever the user's module raises on import, in one line
        raise ValueError(f"{key} = {spec!r}: cannot import ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise ValueError(f"{key} = {spec!r}: not a function")
    return fn


def make_task(cfg, seed: int) -> Task:
    """The recipe's task (`cfg`: its `prl.recipe.schema.TaskCfg`); a ValueError naming the key when a function,
    a reasoning-gym task or its options cannot be used (`prl run` turns it into a refusal before anything
    starts)."""
    dataset, reward = BUILTIN.get(cfg.name, (None, None))
    if cfg.name.startswith("reasoning_gym:"):
        from prl.tasks.reasoning_gym import reasoning_gym_task

        dataset, reward = reasoning_gym_task(cfg.name.partition(":")[2], cfg.options)
    if cfg.dataset:
        dataset = import_function(cfg.dataset, "task.dataset")
    if cfg.reward:
        reward = import_function(cfg.reward, "task.reward")
    return Task(dataset, reward, seed, cfg.min_len, cfg.max_len)

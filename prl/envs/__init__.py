"""Environments: where a rollout's turns, tools and sandboxes live. The orchestrator hands one example
to an environment (`base.Environment`) with a handle to the inference pool and gets back scored
trajectories; it never sees turns. `env.kind` names the class: `single_turn` (today's tasks,
`single_turn.SingleTurnEnv`), `tools` (`tool_env.ToolEnv`), `code` (`code_env.CodeEnv`) or a user's
`module:Class`, imported from the run's working directory or PYTHONPATH. Built-ins and users'
classes go through the same seam (`env_class`, then the class's declarations and `from_context`)."""

from __future__ import annotations

import importlib
import inspect
import re

from prl.envs.base import EnvContext, Environment, EnvWorkload, Sampler, SkipExample, Trajectory
from prl.envs.multi_turn import Episode, MultiTurnEnv
from prl.envs.single_turn import SingleTurnEnv
from prl.recipe.schema import CALLABLE

__all__ = ["BUILTIN", "EnvContext", "EnvWorkload", "Environment", "Episode", "MultiTurnEnv", "Sampler", "SingleTurnEnv",
           "SkipExample", "Trajectory", "env_class", "env_workload", "length_key", "longest_sample", "make_env"]

BUILTIN = {
    "single_turn": "prl.envs.single_turn:SingleTurnEnv",
    "tools": "prl.envs.tool_env:ToolEnv",
    "code": "prl.envs.code_env:CodeEnv",
}
SPEC = re.compile(CALLABLE)


def env_class(kind: str) -> type[Environment]:
    """The class `env.kind` names, checked against the seam; a ValueError (without the key: the launch's
    recipe checks, `prl.launch.checks`, add `env.kind`) saying what to do when it cannot be used."""
    spec = BUILTIN.get(kind, kind)
    if not SPEC.fullmatch(spec):
        raise ValueError(f"{kind!r} is neither a built-in environment ({', '.join(BUILTIN)}) nor 'module:Class'")
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - whatever the user's module raises is reported in one line
        raise ValueError(import_failure(kind, module_name, e)) from None
    cls = getattr(module, name, None)
    if cls is None:
        raise ValueError(f"{kind!r}: module {module_name} has no {name!r}")
    if not inspect.isclass(cls):
        raise ValueError(f"{kind!r} is a {type(cls).__name__}, not a class: env.kind names an environment class")
    if not issubclass(cls, Environment):
        raise ValueError(f"{kind!r}: class {name} is not a subclass of prl.envs.Environment (write "
                         f"`class {name}(Environment)`, or subclass prl.envs.MultiTurnEnv for turns)")
    missing = seam_gaps(cls)
    if missing:
        raise ValueError(f"{kind!r} does not implement the environment seam: {'; '.join(missing)} "
                         f"(see prl.envs.base.Environment)")
    return cls


def import_failure(kind: str, module_name: str, e: Exception) -> str:
    if isinstance(e, ModuleNotFoundError) and (e.name == module_name or module_name.startswith(f"{e.name}.")):
        return (f"{kind!r}: no module named {module_name!r} (run prl from the folder that holds "
                f"{module_name.replace('.', '/')}.py, or add that folder to PYTHONPATH)")
    return f"{kind!r}: importing {module_name} failed: {type(e).__name__}: {' '.join(str(e).split())}"


def seam_gaps(cls: type[Environment]) -> list[str]:
    """What `cls` lacks of the seam, in words (empty: it can be used)."""
    gaps = []
    for attr in ("multi_turn", "needs_sandbox"):
        if not isinstance(getattr(cls, attr, None), bool):
            gaps.append(f"declare {attr} = True or False as a class attribute")
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if abstract:
        gaps.append(f"define {', '.join(abstract)}")
    awaited = ("rollout", "respond") if issubclass(cls, MultiTurnEnv) else ("rollout",)  # prl awaits what they return
    for name in awaited:
        method = getattr(cls, name, None)
        if method is not None and not inspect.iscoroutinefunction(inspect.unwrap(method)):
            gaps.append(f"{name} must be a coroutine: write `async def {name}(...)`")
    return gaps


def env_workload(env, sampling) -> EnvWorkload:
    """`env_class(env.kind).workload(env, sampling)`, checked: what `prl plan` and the recipe's length
    checks assume of a trajectory."""
    w = env_class(env.kind).workload(env, sampling)
    if not isinstance(w, EnvWorkload) or w.turns < 1 or w.env_tokens_per_turn < 0 or w.max_tokens < 1:
        raise ValueError(f"env.kind = {env.kind!r}: workload() must return an EnvWorkload with turns >= 1, "
                         f"env_tokens_per_turn >= 0 and max_tokens >= 1, got {w!r}")
    return w


def longest_sample(env, task, sampling) -> int:
    """A sample's tokens at most: the task's longest prompt (`TaskCfg.longest_prompt`) and what follows it
    (one turn: sampling.max_tokens; with turns, every turn's model and environment tokens)."""
    return task.longest_prompt() + env_workload(env, sampling).max_tokens


def length_key(env) -> str:
    """The key that bounds what follows a prompt: the whole trajectory's with turns, one completion's without."""
    return "env.max_total_tokens" if env_class(env.kind).multi_turn else "sampling.max_tokens"


def make_env(env, task, seed: int, tokenizer, sampling, group_size: int, router_replay: bool,
             sandbox=None) -> Environment:
    """`env`: the recipe's EnvCfg, `task`: its TaskCfg (examples and the reward); `seed`: the data seed
    (a resumed run continues the same order); `sandbox`: where code runs for a class that declares
    `needs_sandbox` (the run's sandbox workers, `prl.sandbox.client.SandboxClient`; None: a pool in this
    process, made on first use)."""
    from prl.tasks import make_task

    cls = env_class(env.kind)
    if cls.needs_sandbox and sandbox is None:
        from prl.envs.code_env import LazySandbox

        sandbox = LazySandbox(env.sandbox)
    ctx = EnvContext(cfg=env, task=make_task(task, seed), tokenizer=tokenizer, sampling=sampling,
                     group_size=group_size, router_replay=router_replay,
                     sandbox=sandbox if cls.needs_sandbox else None)
    return cls.from_context(ctx)

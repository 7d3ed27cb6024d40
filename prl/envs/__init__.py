"""Environments: where a rollout's turns, tools and sandboxes live. The orchestrator hands one example
to an environment (`base.Environment`) with a handle to the inference pool and gets back scored
trajectories; it never sees turns. `make_env` builds the recipe's `[env]`: `single_turn` (today's
tasks, `single_turn.SingleTurnEnv`), `tools` (`tool_env.ToolEnv`) or `code` (`code_env.CodeEnv`)."""

from prl.envs.base import Environment, Sampler, Trajectory
from prl.envs.single_turn import SingleTurnEnv

__all__ = ["Environment", "Sampler", "SingleTurnEnv", "Trajectory", "make_env"]


def make_env(env, task, seed: int, tokenizer, sampling, group_size: int, router_replay: bool,
             sandbox=None) -> Environment:
    """`env`: the recipe's EnvCfg, `task`: its TaskCfg (examples and, for single turns and tools, the
    reward); `seed`: the data seed (a resumed run continues the same order); `sandbox`: where code
    runs (`env.kind = "code"`: the run's sandbox workers, `prl.sandbox.client.SandboxClient`; None:
    a pool in this process, made on first use)."""
    from prl.tasks import make_task

    task = make_task(task, seed)
    if env.kind == "single_turn":
        return SingleTurnEnv(task, tokenizer, sampling, group_size, router_replay)
    from prl.envs.formats import make_format

    common = dict(task=task, tokenizer=tokenizer, fmt=make_format(env.format, tokenizer), sampling=sampling,
                  group_size=group_size, router_replay=router_replay, max_turns=env.max_turns,
                  max_total_tokens=env.max_total_tokens)
    if env.kind == "tools":
        from prl.envs.tool_env import ToolEnv
        from prl.envs.tools import ToolBox, load_tool

        box = ToolBox([load_tool(t) for t in env.tools], env.tool_timeout_s, env.max_env_chars)
        return ToolEnv(box, **common)
    from prl.envs.code_env import CodeEnv, LazySandbox

    return CodeEnv(sandbox or LazySandbox(env.sandbox), env.language, env.max_env_chars, env.attempt_penalty,
                   env.fail_credit, **common)

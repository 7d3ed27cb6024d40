"""Environments: where a rollout's turns, tools and sandboxes live. The orchestrator hands one example
to an environment (`base.Environment`) with a handle to the inference pool and gets back scored
trajectories; it never sees turns. `make_env` builds the recipe's environment (today: the task's
single-turn case, `single_turn.SingleTurnEnv`)."""

from prl.envs.base import Environment, Sampler, Trajectory
from prl.envs.single_turn import SingleTurnEnv

__all__ = ["Environment", "Sampler", "SingleTurnEnv", "Trajectory", "make_env"]


def make_env(cfg, tokenizer) -> Environment:
    """The recipe's environment for an orchestrator (`prl.recipe.roles.OrchestratorConfig`)."""
    from prl.tasks import make_task

    return SingleTurnEnv(make_task(cfg.task, cfg.run.seed), tokenizer, cfg.sampling, cfg.rl.group_size,
                         cfg.router_replay)

"""Eval sets from the recipe: each `[eval.<name>]` as an environment of its own (its task, its
environment, its sampling, `samples` completions per example) over its held-out indices."""

from __future__ import annotations

from dataclasses import dataclass

from prl.envs import Environment, make_env

VERBATIM_SCAN = 10_000  # training indices compared with an eval set's prompts, at most


@dataclass
class EvalSet:
    name: str
    cfg: object  # prl.recipe.schema.EvalCfg
    env: Environment
    first: int  # its first example index
    verbatim_share: float | None = None  # its prompts that training's first indices show verbatim (None: unknown)

    def indices(self) -> range:
        return range(self.first, self.first + self.cfg.examples)


def build_sets(evals: dict, task, env, sampling, seed: int, tokenizer, sandbox=None,
               train_env: Environment | None = None, training_reach: int = 0) -> list[EvalSet]:
    """`evals`: the recipe's `eval` tables; `task`, `env`, `sampling`: the recipe's, which a set uses
    where it sets none of its own; `train_env` and `training_reach`: where training's prompts come
    from and how many it can take, for the share of the set's prompts training also shows."""
    out = []
    for name, ev in evals.items():
        own = sampling.model_copy(update={"temperature": ev.temperature, "top_p": ev.top_p,
                                          "max_tokens": ev.max_tokens or sampling.max_tokens})
        set_env = make_env(ev.env or env, ev.task or task, seed, tokenizer, own, ev.samples, False, sandbox=sandbox)
        s = EvalSet(name, ev, set_env, ev.start(task))
        if train_env is not None:
            s.verbatim_share = verbatim_share(s, train_env, min(training_reach, VERBATIM_SCAN))
        out.append(s)
    return out


def verbatim_share(s: EvalSet, train_env: Environment, reach: int) -> float | None:
    """The share of the set's prompts that one of training's first `reach` examples has word for word
    (tiny tasks draw from small alphabets); None where examples have no "prompt"."""
    try:
        seen = {train_env.example(i)["prompt"] for i in range(reach)}
        prompts = [s.env.example(i)["prompt"] for i in s.indices()]
    except (KeyError, TypeError):
        return None
    return round(sum(p in seen for p in prompts) / len(prompts), 4)

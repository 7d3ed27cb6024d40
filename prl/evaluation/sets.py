"""Eval sets from the recipe: each `[eval.<name>]` as an environment of its own (its task, its
environment, its sampling, `samples` completions per example) over its held-out indices.

A set prl places (the training task's examples, `first_index` unset) holds no prompt training can
draw: training's prompts are generated (the RL stream's first `training_reach` indices and the warm
start's demonstrations, each up to `TRAINING_SCAN`), and an example whose prompt is one of them is
replaced by the next index whose prompt is not (`replaced` counts them). Tiny tasks draw from small
alphabets, so a far index can still be a training prompt. A set the user places (a task of its own,
or its own `first_index`) keeps its indices, and `verbatim_share` says how many of its prompts
training shows. The launch builds the sets as the orchestrator does (`check_held_out`), so a set the
run could not build is refused before anything starts, and warns where training draws past
`TRAINING_SCAN` (`scan_warnings`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prl.envs import Environment, SkipExample, make_env
from prl.tasks import WARM_START_SEED_OFFSET
from prl.tasks.files import row_count

TRAINING_SCAN = 20_000  # prompts of each training stream generated to compare with, at most
REPLACE_SCAN = 16  # a held-out set looks at most this many indices per example for prompts training cannot draw

Stream = tuple[Callable[[int], dict], int]  # where training's examples come from (index -> example), how many


class EvalSetError(ValueError):
    """A held-out set that cannot be built, in one line naming the key."""


@dataclass
class EvalSet:
    name: str
    cfg: object  # prl.recipe.schema.EvalCfg
    env: Environment
    first: int  # its first example index
    examples: int = 0  # examples it scores (`EvalCfg.count`: a dataset file's rows, or eval.<name>.examples)
    picked: list[int] | None = None  # the indices it scores (None: first .. first + examples - 1)
    verbatim_share: float | None = None  # its prompts that training shows verbatim (None: unknown)
    replaced: int | None = None  # examples replaced as training prompts (None: a set the user placed)

    def indices(self) -> list[int] | range:
        return self.picked if self.picked is not None else range(self.first, self.first + self.examples)


def build_sets(evals: dict, task, env, sampling, seed: int, tokenizer, sandbox=None,
               training: list[Stream] = ()) -> list[EvalSet]:
    """`evals`: the recipe's `eval` tables; `task`, `env`, `sampling`: the recipe's, which a set uses
    where it sets none of its own; `training`: the streams training draws its prompts from."""
    seen = training_prompts(training)
    out = []
    for name, ev in evals.items():
        own = sampling.model_copy(update={"temperature": ev.temperature, "top_p": ev.top_p,
                                          "max_tokens": ev.max_tokens or sampling.max_tokens})
        set_task = ev.set_task(task)
        set_env = make_env(ev.env or env, set_task, seed, tokenizer, own, ev.samples, False, sandbox=sandbox)
        s = EvalSet(name, ev, set_env, ev.start(task), ev.count(row_count(set_task)))
        if seen is not None and held_out_by_prl(ev, task):
            s.picked, s.replaced = held_out(name, set_env.example, s.first, s.examples, seen)
        if seen is not None:
            s.verbatim_share = verbatim_share(set_env.example, s.indices(), seen)
        out.append(s)
    return out


def held_out_by_prl(ev, recipe_task) -> bool:
    """Whether prl placed the set among the training task's examples (so it keeps training's prompts out)."""
    return ev.first_index is None and ev.draws_training_data(recipe_task)


def training_prompts(streams: list[Stream]) -> set | None:
    """Every prompt of each stream's first indices (up to `TRAINING_SCAN`); None without streams, or where
    examples have no "prompt" to compare."""
    if not streams:
        return None
    try:
        return {p for example, reach in streams for p in prompts(example, range(min(reach, TRAINING_SCAN)))}
    except (KeyError, TypeError):
        return None


def prompts(example: Callable[[int], dict], indices) -> list:
    """The prompts of the examples at `indices`, past those a run skips (`SkipExample`: a row that is no example)."""
    out = []
    for i in indices:
        try:
            out.append(prompt_of(example(i)))
        except SkipExample:
            continue
    return out


def prompt_of(example: dict):
    """The example's prompt as a value a set can hold (a conversation's turns as a tuple)."""
    p = example["prompt"]
    return tuple(map(repr, p)) if isinstance(p, list) else p


def held_out(name: str, example: Callable[[int], dict], first: int, examples: int, seen: set) -> tuple[list[int], int]:
    """`examples` indices from `first` on whose prompts are not in `seen`, and how many were passed over;
    EvalSetError where `REPLACE_SCAN` x `examples` indices do not hold that many."""
    picked, index, last = [], first, first + REPLACE_SCAN * examples
    while len(picked) < examples and index < last:
        if prompt_of(example(index)) not in seen:
            picked.append(index)
        index += 1
    if len(picked) < examples:
        raise EvalSetError(f"eval.{name}: only {len(picked)} of indices {first}..{last - 1} of the training task have "
                           f"prompts training cannot draw, short of eval.{name}.examples = {examples}: the task has "
                           f"few distinct prompts; lower examples, or give the set a task of its own ([eval.{name}.task])")
    return picked, index - first - examples


def verbatim_share(example: Callable[[int], dict], indices, seen: set) -> float | None:
    """The share of the examples' prompts that training shows word for word; None where they have none."""
    try:
        got = prompts(example, indices)
        return round(sum(p in seen for p in got) / len(got), 4) if got else None
    except (KeyError, TypeError):
        return None


def run_streams(cfg, train_env: Environment, tokenizer) -> list[Stream]:
    """Training's streams in a run (`OrchestratorConfig`): RL's examples from the orchestrator's
    environment, and the warm start's demonstrations, drawn as the trainer draws them."""
    return streams(cfg.env, cfg.task, cfg.run.seed, cfg.sampling, tokenizer,
                   [(train_env.example, cfg.training_reach)], cfg.warm_start_examples, sft_file(cfg.sft))


def streams(env, task, seed: int, sampling, tokenizer, rl: list[Stream], demos: int, sft_data=None) -> list[Stream]:
    """`rl` (RL's stream) and the warm start's `demos` demonstrations, from an environment built as the
    trainer builds the warm start's (`sft_data`: the recipe's [sft] where it reads a file)."""
    from prl.envs.sft_data import warm_start_source

    warm = warm_start_source(env, task, sft_data, seed + WARM_START_SEED_OFFSET, tokenizer, sampling)
    return [*rl, (warm.example, demos)]


def sft_file(sft):
    """The recipe's [sft] where the warm start reads a file, else None."""
    return sft if sft is not None and sft.data is not None else None


def warm_start_examples(recipe) -> int:
    """The demonstrations the warm start draws (`sft.steps` x `sft.batch_size`; unset steps follow `model.path`)."""
    return recipe.sft.steps_for(recipe.model) * recipe.sft.batch_size


def recipe_tokenizer(model):
    """The tokenizer of the run's model folder: `model.path`'s, or the tiny model's characters."""
    from prl.model.build import load_tokenizer
    from prl.model.tiny import char_tokenizer

    return load_tokenizer(model.path) if model.path else char_tokenizer()


def check_held_out(recipe, tokenizer=None, train_env=None) -> None:
    """The recipe's sets built as the orchestrator builds them (its environments, training's streams from
    them, `build_sets`), so each set prl places holds `examples` prompts training cannot draw; EvalSetError
    naming the set. `tokenizer`: the run's (default: `recipe_tokenizer`); `train_env`: the training environment
    (default: built here)."""
    if not any(held_out_by_prl(ev, recipe.task) for ev in recipe.eval.values()):
        return
    tokenizer = tokenizer or recipe_tokenizer(recipe.model)
    if train_env is None:
        train_env = make_env(recipe.env, recipe.task, recipe.run.seed, tokenizer, recipe.sampling, recipe.rl.group_size,
                             recipe.trainer.router_replay)
    training = streams(recipe.env, recipe.task, recipe.run.seed, recipe.sampling, tokenizer,
                       [(train_env.example, recipe.training_reach())], warm_start_examples(recipe), sft_file(recipe.sft))
    build_sets(recipe.eval, recipe.task, recipe.env, recipe.sampling, recipe.run.seed, tokenizer, training=training)


def distinct(drawn: int, task, path: str | None = None) -> int:
    """Of `drawn` examples, how many can differ: a dataset file (`path`, else the task's) repeats after its rows."""
    from prl.tasks.files import open_source

    path = path or task.data
    if path is None:
        return drawn
    return min(drawn, len(open_source(path, task.rows if path == task.data else None, True)))


def scan_warnings(recipe) -> list[str]:
    """A line for each set where training draws more of a stream than the `TRAINING_SCAN` prompts compared
    with the set's: a prompt only a later index draws may be in it, uncounted."""
    drawn = {"RL examples": distinct(recipe.training_reach(), recipe.task),
             "warm-start demonstrations": distinct(warm_start_examples(recipe), recipe.task, recipe.sft.data)}
    past = [f"{n} {what}" for what, n in drawn.items() if n > TRAINING_SCAN]
    if not past:
        return []
    return [f"eval.{name}: training draws {' and '.join(past)}, past the first {TRAINING_SCAN} of each that are "
            f"compared with the set's prompts: a prompt only a later one draws is neither left out nor counted in "
            f"verbatim_share" for name in recipe.eval]

"""The recipe checks that need the classes a recipe names, run where a run is launched.

The schema (`prl.recipe.schema`) is data and the checks that need no project module. What needs a
class is checked here: the environment class `env.kind` names (the seam, turns, demonstrations, its
workload and with it the longest sample), the model family's spec (`prl.model.families`: context
parallelism, LoRA targets) and the inference backend's spec (`prl.backends.registry`: its name,
arguments, layouts and refusals). `load` runs the schema, then these: `prl run`, `--dry-run`,
`--resume`, `prl plan`, `prl doctor` and `prl eval` refuse a bad recipe alike, in one line naming the
file and the key, before anything starts.

Each check raises a ValueError whose message starts with the dotted key.
"""

from __future__ import annotations

from pathlib import Path

from prl import envs
from prl.backends import registry
from prl.model import families
from prl.recipe.load import RecipeError, load_recipe, refusal, set_keys
from prl.recipe.schema import BUILTIN_OBJECTIVES, LAYOUT_KEYS, EnvCfg, Recipe


def load(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """The recipe at `path` with `--set` overrides, validated by the schema and by `check_recipe`."""
    return checked(load_recipe(path, overrides), str(path), set_keys(overrides))


def checked(recipe: Recipe, source: str, given: list[str] = ()) -> Recipe:
    """`recipe` once `check_recipe` passes; else a RecipeError naming `source` (or the `--set` key)."""
    try:
        check_recipe(recipe)
    except ValueError as e:
        raise RecipeError(refusal(str(e), source, given)) from None
    return recipe


def check_recipe(recipe: Recipe) -> None:
    """Every check that needs a class; the first that fails raises."""
    check_envs(recipe)
    check_backend(recipe)
    check_family(recipe)
    check_backend_rules(recipe)
    check_lengths(recipe)
    check_evals(recipe)
    check_objective_layout(recipe)


def check_objective_layout(recipe: Recipe) -> None:
    """A built-in objective that reads whole samples (its flag, next to its function) has no context
    parallelism; a user's objective is imported and checked by `prl run`'s preflight."""
    loss, cp = recipe.trainer.loss, recipe.trainer.parallel.cp
    if cp == 1 or loss.correction not in BUILTIN_OBJECTIVES:
        return
    from prl.trainer.loss import BUILTIN, layout_refusal

    if why := layout_refusal(loss.correction, BUILTIN[loss.correction], cp):
        raise ValueError(why)


def not_built(recipe: Recipe) -> list[str]:
    """Valid settings whose implementation does not exist yet: the recipe's own and its backend's."""
    return recipe.not_built() + registry.get(recipe.inference.backend).not_built(recipe)


def env_class(env: EnvCfg, key: str = "env") -> type[envs.Environment]:
    """The class `env.kind` names (`prl.envs.env_class`); `key`: where `env` sits in the recipe."""
    try:
        return envs.env_class(env.kind)
    except ValueError as e:
        raise ValueError(f"{key}.kind: {e}") from None


def check_envs(recipe: Recipe) -> None:
    """Each environment's class can be used, and it has what turn credit and the warm start ask of it."""
    cls = env_class(recipe.env)
    for name, ev in recipe.eval.items():
        if ev.env is not None:
            env_class(ev.env, f"eval.{name}.env")
    if recipe.rl.credit == "turn" and not cls.multi_turn:
        raise ValueError(f"rl.credit = 'turn' needs a multi-turn environment (e.g. env.kind = 'code' or 'tools'); "
                         f"env.kind = {recipe.env.kind!r} has one turn: use 'trajectory'")
    if recipe.sft.steps_for(recipe.model) and not cls.has_demonstrations():
        raise ValueError(f"sft.steps: the warm start learns from demonstrations and env.kind = "
                         f"{recipe.env.kind!r} has none: set sft.steps = 0 (a tiny model's default is 40) or "
                         f"write demonstration(index)")


def check_backend(recipe: Recipe) -> None:
    """The backend is registered; its passthrough table holds no argument prl sets, no other backend's
    table is given, and a serving layout is asked only of a backend that serves one."""
    inf = recipe.inference
    spec = registry.get(inf.backend)  # an unknown name is refused, listing the registered ones
    for name in registry.names():  # each backend's passthrough table, e.g. [inference.vllm]
        if getattr(inf, name, None) and name != inf.backend:
            raise ValueError(f"inference.{name}: only used with inference.backend = {name!r}")
    own = sorted(k for k in (getattr(inf, inf.backend, None) or {}) if k.replace("-", "_") in spec.owned_args)
    if own:
        k = own[0]
        raise ValueError(f"inference.{inf.backend}.{k}: prl sets --{k.replace('_', '-')} itself (from "
                         f"{spec.owned_args[k.replace('-', '_')]}); remove it")
    changed = [k for k in LAYOUT_KEYS if getattr(inf, k) != type(inf).model_fields[k].default]
    if changed and not getattr(spec, "serves_layouts", False):
        raise ValueError(f"inference.{changed[0]}: only used with inference.backend = 'vllm'; the "
                         f"{inf.backend!r} engine runs one replica per server (inference.num_servers or "
                         f"[placement]), keeps its KV in the compute dtype and does not decode speculatively")


def check_backend_rules(recipe: Recipe) -> None:
    """What the backend can never serve (its spec's `check_recipe`, naming the key)."""
    registry.get(recipe.inference.backend).check_recipe(recipe)


def check_family(recipe: Recipe) -> None:
    """What the model family's spec must have: context parallelism's adapter, and a module in the LoRA targets
    (a tiny model; a pretrained folder's targets are checked from its tensor names, `driver.check_lora_targets`)."""
    par, m = recipe.trainer.parallel, recipe.model
    if par.cp > 1 and m.arch not in families.with_feature("cp"):
        raise ValueError(f"trainer.parallel.cp > 1: context parallelism is built for GLM-5's DSA attention "
                         f"(model.arch in {families.with_feature('cp')}), not {m.arch!r}")
    lora = recipe.trainer.lora
    if lora.enabled and m.path is None and not any(tiny_has_group(recipe, g) for g in lora.targets):
        raise ValueError(f"trainer.lora.targets = {lora.targets}: model.arch {m.arch!r} with "
                         f"model.first_dense_layers = {m.first_dense_layers} of model.num_layers = {m.num_layers} "
                         f"has no module in these groups; add 'attention'")


def tiny_has_group(recipe: Recipe, group: str) -> bool:
    """Whether the tiny model holds a module of LoRA target `group`: the dense MLP sits in the first
    `first_dense_layers` layers, shared and routed experts in the layers after them (its MoE layers)."""
    m = recipe.model
    dense, moe = m.first_dense_layers > 0, m.first_dense_layers < m.num_layers
    if group == "routed_experts":
        return moe
    where = {"attention": True, "mlp": dense, "shared_experts": moe}[group]
    return where and bool(families.FAMILIES[m.arch].lora_groups.get(group))


def check_lengths(recipe: Recipe) -> None:
    """The longest sample (the environment's workload says what follows the prompt) fits the tiny model's
    positions (a folder's: `driver.check_model`) and one micro-batch row."""
    longest = envs.longest_sample(recipe.env, recipe.task, recipe.sampling)
    if recipe.model.path is None and longest > recipe.model.max_position_embeddings:
        raise ValueError(f"model.max_position_embeddings ({recipe.model.max_position_embeddings}) is shorter than the "
                         f"longest sample ({longest} tokens); raise it or lower {envs.length_key(recipe.env)}")
    if recipe.trainer.micro_batch_tokens < longest:
        raise ValueError(f"trainer.micro_batch_tokens ({recipe.trainer.micro_batch_tokens}) must hold one whole "
                         f"sample ({longest} tokens); raise it or lower {envs.length_key(recipe.env)}")


def check_evals(recipe: Recipe) -> None:
    """Each eval set's environment runs where the run has what it needs, and its longest sample fits."""
    for name, ev in recipe.eval.items():
        key, env = f"eval.{name}", ev.env or recipe.env
        if env_class(env, f"{key}.env").needs_sandbox and not env_class(recipe.env).needs_sandbox:
            raise ValueError(f"{key}.env: env.kind = {env.kind!r} runs model-written code, and the run starts sandbox "
                             f"workers only for a training environment that does; evaluate it in a run that trains "
                             f"on it")
        sampling = recipe.sampling.model_copy(update={"max_tokens": ev.max_tokens or recipe.sampling.max_tokens})
        longest = envs.longest_sample(env, ev.set_task(recipe.task), sampling)
        if recipe.model.path is None and longest > recipe.model.max_position_embeddings:
            bound = f"{key}.env.max_total_tokens" if envs.env_class(env.kind).multi_turn else f"{key}.max_tokens"
            raise ValueError(f"{bound}: the set's longest sample ({longest} tokens) is longer than "
                             f"model.max_position_embeddings ({recipe.model.max_position_embeddings}); lower it")

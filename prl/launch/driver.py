"""`prl run`: resolve the recipe once, write per-process configs, start, watch, tear down.

Rules: a bad recipe fails before anything starts; a process that dies or hangs is restarted up to
`run.max_restarts` times (`prl.launch.faults`); the run ends when the trainer finishes, when a
process fails past its restarts (named, with its last log lines), or on Ctrl-C/SIGTERM; in every
case all processes are stopped (`Supervisor.stop_all`) before `prl run` returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.live import Live

from prl.backends import registry
from prl.envs import env_class, length_key, longest_sample
from prl.system import gpu_present
from prl.launch import checks
from prl.launch.configs import resolve
from prl.launch.faults import Faults, RestartFailed
from prl.launch.processes import format_plan, make_plan
from prl.launch.hosts import NO_STATUS, HostError, LocalHost
from prl.launch.supervisor import Supervisor
from prl.launch.wandb_log import WandbError, WandbSink, check_wandb
from prl.metrics import EventLog, read_events
from prl.model.weights import WEIGHTS_PREFIX, published_versions, sealed, version_dir
from prl.recipe.load import RecipeError, apply_override, inherit_eval_tables, set_keys, validate
from prl.recipe.reference import recipe_toml
from prl.recipe.resolve import write_configs, write_secret
from prl.transport.ports import PORTS
from prl.recipe.schema import Recipe
from prl.tui.state import RunState, summarize
from prl.tui.keys import KeyReader
from prl.tui.view import render
from prl.usercode import described



class RunStopped(Exception):
    pass


@dataclass
class Outcome:
    state: str  # done | failed | interrupted
    message: str
    code: int
    failed: str | None = None  # the process that ended the run


def run_dir_for(recipe: Recipe) -> Path:
    return Path(recipe.run.output_dir) / recipe.run.name


def dry_run(recipe: Recipe, console: Console, run_dir: Path | None = None) -> int:
    """Every key of the resolved recipe, the process plan and the plan's summary; nothing starts.
    `run_dir`: a resumed run's directory (default: the recipe's)."""
    try:
        preflight(recipe)
    except RecipeError as e:
        console.print(f"prl run: {e}", style="red", markup=False, highlight=False)
        return 2
    warn_scan(recipe, console)
    if run_dir is not None:
        steps = sealed(run_dir / "checkpoints", "step_")
        console.print(f"# resuming {run_dir} " + (f"from its checkpoint at step {steps[-1]}: what it produced after "
                      f"that step is dropped" if steps else "from step 0 (it has no checkpoint yet)"),
                      style="bold", markup=False, highlight=False)
    run_dir = run_dir or run_dir_for(recipe)
    if recipe.cluster is None:
        specs = make_plan(resolve(recipe, run_dir, run_dir / "secret"), run_dir)
    else:
        from prl.launch.cluster import dry_run_plan

        specs = dry_run_plan(recipe, run_dir)
    console.print("# resolved recipe: every key (unset ones commented)", style="bold")
    console.print(recipe_toml(recipe), markup=False, highlight=False)
    console.print()
    console.print(format_plan(specs, recipe), markup=False, highlight=False, soft_wrap=True)
    console.print(plan_summary(recipe), markup=False, highlight=False)
    for line in data_lines(recipe):
        console.print(line, markup=False, highlight=False)
    if recipe.trainer.lora.enabled:
        console.print(lora_line(recipe), markup=False, highlight=False)
    for item in checks.not_built(recipe):
        console.print(f"prl run would refuse: {item}", style="yellow", markup=False, highlight=False)
    return 0


def data_lines(recipe: Recipe) -> list[str]:
    """The run's dataset files with the rows each gives (opened by the preflight already)."""
    from prl.tasks.files import open_source

    sets = {n: ev.set_task(recipe.task) for n, ev in recipe.eval.items()}
    files = [("task.data", recipe.task.data, recipe.task.rows), ("sft.data", recipe.sft.data, None),
             *((f"eval.{n}.data", t.data, t.rows) for n, t in sets.items())]
    out = []
    for key, path, rows in files:
        if path is not None:
            span = f" [{rows[0]}, {rows[1]})" if rows else ""
            out.append(f"# {key}: {path}{span}, {len(open_source(path, rows, False))} rows")
    return out


def lora_line(recipe: Recipe) -> str:
    lora = recipe.trainer.lora
    return (f"# LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {', '.join(lora.targets)}: weights v0 is the base, whole; "
            f"every later version is the adapters alone, which each {recipe.inference.backend} server merges into its "
            f"copy of the base's target weights (served merged: no backend is sent unmerged adapters)")


def refuse_not_built(recipe: Recipe) -> None:
    missing = checks.not_built(recipe)
    if missing:
        raise RunStopped("not built yet, nothing was started (`--dry-run` and `prl plan` show the plan):\n  "
                         + "\n  ".join(missing))


def plan_summary(recipe: Recipe) -> str:
    from prl.sizing.estimate import make_plan, summary

    try:
        return summary(make_plan(recipe))
    except ValueError as e:
        return f"prl plan: not estimated ({e})"


def local_folder(recipe: Recipe):
    """The pretrained `model.path`, read once (headers only) for every preflight check; None for a tiny
    model or on a cluster (the folder lives on the hosts; `prl doctor` checks it there)."""
    from prl.model.pretrained import PretrainedError, check_pretrained

    if not recipe.model.path or recipe.cluster is not None:
        return None
    try:
        return check_pretrained(recipe.model.path)
    except PretrainedError as e:
        raise RecipeError(f"model.path: {e}; nothing was started") from None


def check_model(recipe: Recipe, folder) -> None:
    """A broken pretrained folder fails before any process starts."""
    from prl.model.families import with_feature

    if folder is None:
        return
    m = recipe.model
    longest = longest_sample(recipe.env, recipe.task, recipe.sampling)
    if folder.max_position_embeddings and longest > folder.max_position_embeddings:
        raise RecipeError(f"model.path: {m.path} holds {folder.max_position_embeddings} positions, shorter than the "
                          f"longest sample ({longest} tokens); lower {length_key(recipe.env)}")
    if recipe.trainer.router_replay and folder.model_type not in with_feature("r3"):
        raise RecipeError(f"trainer.router_replay: model_type {folder.model_type!r} of {m.path} has no routing "
                          f"adapter (known: {with_feature('r3')}); set trainer.router_replay = false")
    check_lora_targets(recipe, folder)
    par = recipe.trainer.parallel
    if par.cp > 1 and folder.model_type not in with_feature("cp"):
        raise RecipeError(f"trainer.parallel.cp = {par.cp}: context parallelism is built for GLM-5's DSA attention "
                          f"(model_type in {with_feature('cp')}); {m.path} is {folder.model_type!r}; use cp = 1")
    if par.ep > 1 and (folder.num_experts is None or folder.num_experts % par.ep):
        raise RecipeError(f"trainer.parallel.ep = {par.ep} must divide the routed experts of {m.path} "
                          f"({folder.num_experts or 'none'})")


def check_lora_targets(recipe: Recipe, folder) -> None:
    from prl.model.families import folder_has_targets

    lora = recipe.trainer.lora
    if lora.enabled and not folder_has_targets(folder.model_type, folder.names, folder.num_experts, lora.targets):
        raise RecipeError(f"trainer.lora.targets = {lora.targets}: {recipe.model.path} ({folder.model_type!r}) has no "
                          f"module in these groups; add 'attention'")


def preflight(recipe: Recipe) -> None:
    """Everything `prl run` checks before starting processes; `--dry-run` runs the same checks."""
    folder = local_folder(recipe)
    check_model(recipe, folder)
    tokenizer = local_tokenizer(recipe)
    check_teacher(recipe, tokenizer)
    check_reward_model(recipe)
    check_judge(recipe)
    check_device(recipe)
    check_backend(recipe, folder)
    check_kv_pool(recipe)
    check_task(recipe, tokenizer)
    check_objective(recipe)
    check_wandb(recipe)


def served_folder(key: str, path: str, check):
    """A model folder the run serves beside the policy (`key` its recipe key): `check(path)`'s FolderInfo, with its
    tokenizer; a RecipeError in one line otherwise."""
    from prl.model.build import load_tokenizer
    from prl.model.pretrained import PretrainedError

    try:
        return check(path), load_tokenizer(path)
    except PretrainedError as e:
        raise RecipeError(f"{key}: {e}; nothing was started") from None
    except Exception as e:  # noqa: BLE001 - transformers' own errors on a folder it cannot read
        raise RecipeError(f"{key}: {path}: its tokenizer cannot be read ({type(e).__name__}: {e}); nothing was "
                          f"started") from None


def check_teacher(recipe: Recipe, ours) -> None:
    """`[teacher]`: a language model folder here whose tokenizer is the student's (`ours`, None on a cluster: its
    logprobs are of the same tokens)."""
    from prl.model.pretrained import check_language_model

    if recipe.teacher is None:
        return
    _, theirs = served_folder("teacher.path", recipe.teacher.path, check_language_model)
    if ours is not None and ours.get_vocab() != theirs.get_vocab():
        raise RecipeError(f"teacher.path: {recipe.teacher.path} has another vocabulary ({len(theirs)} tokens, the "
                          f"student's {len(ours)}): a teacher scores the student's tokens, so it needs the student's "
                          f"tokenizer (distillation across tokenizers is not built); nothing was started")


def check_reward_model(recipe: Recipe) -> None:
    """`[reward.model]`: a sequence-classification folder here, of one label, that transformers can build and whose
    tokenizer loads."""
    rm = recipe.reward.model
    if rm is None:
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as KNOWN

    from prl.model.pretrained import check_reward_model as check_folder

    info, _ = served_folder("reward.model.path", rm.path, check_folder)
    if info.model_type not in KNOWN:
        raise RecipeError(f"reward.model.path: {rm.path}: transformers has no sequence classifier for model_type "
                          f"{info.model_type!r}; nothing was started")


def check_judge(recipe: Recipe) -> None:
    """`[reward.judge]`: a language model folder here for a judge the run serves, its API key's variable set for an
    outside one, and its parser importable."""
    import os

    from prl.model.pretrained import check_language_model
    from prl.tasks import import_function

    judge = recipe.reward.judge
    if judge is None:
        return
    if judge.path is not None:
        served_folder("reward.judge.path", judge.path, check_language_model)
    if judge.api_key_env is not None and not os.environ.get(judge.api_key_env):
        raise RecipeError(f"reward.judge.api_key_env = {judge.api_key_env!r}: that variable is not set here; export "
                          f"it with the judge's API key before prl run; nothing was started")
    if judge.parser is not None:
        try:
            import_function(judge.parser, "reward.judge.parser")
        except ValueError as e:
            raise RecipeError(f"{e}; nothing was started") from None


def check_device(recipe: Recipe) -> None:
    """What needs an NVIDIA GPU, refused on this machine without one (a cluster's hosts: `prl doctor`)."""
    if recipe.cluster is None and recipe.trainer.backend == "nccl" and not gpu_present():
        raise RecipeError("trainer.backend = 'nccl' needs an NVIDIA GPU and this machine has none (nvidia-smi lists "
                          "none): set it to 'auto' (nccl with a GPU, gloo without) or 'gloo'; nothing was started")


def check_objective(recipe: Recipe) -> None:
    """A user's objective (`trainer.loss.correction = "module:function"`) imports and, on a small batch,
    returns a per-token loss with a gradient, and an objective that needs whole samples has no context
    parallelism; else one line naming the key, before anything starts. A built-in one on one context rank needs no
    check (nor torch, which the rest of the checks leave unimported)."""
    from prl.recipe.schema import BUILTIN_OBJECTIVES

    if recipe.trainer.loss.correction in BUILTIN_OBJECTIVES and recipe.trainer.parallel.cp == 1:
        return
    from prl.trainer.loss import ObjectiveError, check_objective

    try:
        check_objective(recipe.trainer.loss, recipe.trainer.parallel.cp)
    except ObjectiveError as e:
        raise RecipeError(f"{e}; nothing was started") from None


def check_kv_pool(recipe: Recipe) -> None:
    """`inference.kv_pool` needs Mooncake (its store client and `mooncake_master`) where it runs."""
    if not recipe.inference.kv_pool.enabled or recipe.cluster is not None:  # hosts: checked by prl doctor
        return
    from prl.inference.kv_master import probe_mooncake

    why = probe_mooncake()
    if why is not None:
        raise RecipeError(f"inference.kv_pool: Mooncake cannot run here: {why.strip().splitlines()[-1]} (pip install "
                          "mooncake-transfer-engine-non-cuda, or mooncake-transfer-engine with CUDA, bin/prl installs "
                          "it; its store links libibverbs: apt-get install libibverbs1); nothing was started")


def check_backend(recipe: Recipe, folder) -> None:
    """What the chosen inference backend cannot do where the servers run, refused with the reason
    (the backend's spec in `prl.backends.registry` knows). `folder`: `local_folder(recipe)`."""
    why = registry.get(recipe.inference.backend).preflight(recipe, folder)
    if why:
        raise RecipeError(why)


def check_task(recipe: Recipe, tokenizer=None) -> None:
    """Import user task functions and open data files now (the recipe's, each eval set's, the warm start's), so a
    typo fails before any process starts. `tokenizer`: the run's (default: `local_tokenizer`)."""
    tokenizer = local_tokenizer(recipe) if tokenizer is None else tokenizer
    try_task(recipe.task, recipe.run.seed, "task", 0, tokenizer)
    for name, ev in recipe.eval.items():
        if ev.task is not None or ev.data is not None:
            key = f"eval.{name}.data" if ev.data is not None else f"eval.{name}.task"
            try_task(ev.set_task(recipe.task), recipe.run.seed, key, ev.start(recipe.task), tokenizer)
    check_sft_data(recipe, tokenizer)
    env = check_env_builds(recipe, tokenizer)
    check_held_out(recipe, tokenizer, env)
    check_env(recipe)


def check_env_builds(recipe: Recipe, tokenizer):
    """The training environment, built as the orchestrator builds it (a user's `from_context`), which gives its first
    example; else one line naming the user's function, before anything starts. None where the model's folder is not
    here (a cluster's: the run builds it)."""
    from prl.envs import Environment, SkipExample, make_env

    if tokenizer is None:
        return None
    try:
        env = make_env(recipe.env, recipe.task, recipe.run.seed, tokenizer, recipe.sampling, recipe.rl.group_size,
                       recipe.trainer.router_replay)
        if not isinstance(env, Environment):
            raise RecipeError(f"env.kind = {recipe.env.kind!r}: from_context returned {type(env).__name__}, not the "
                              f"environment; nothing was started")
        env.example(0)
    except RecipeError:
        raise
    except SkipExample:  # a first row that cannot be an example: the data checks say so
        return env
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's environment: named in one line
        raise RecipeError(f"env.kind = {recipe.env.kind!r}: the environment cannot be built as the run builds it: "
                          f"{described(e)}; nothing was started") from None
    return env


def local_tokenizer(recipe: Recipe):
    """The run's tokenizer where its folder is on this machine (None: the prompt checks wait for the run)."""
    from prl.evaluation.sets import recipe_tokenizer

    try:
        return recipe_tokenizer(recipe.model)
    except Exception:  # noqa: BLE001 - a folder elsewhere (a cluster's) or a broken one: refused by its own check
        return None


def check_held_out(recipe: Recipe, tokenizer=None, train_env=None) -> None:
    """The eval sets build as the orchestrator will build them (its environments, the run's tokenizer): each
    held-out set of the training task finds its examples among prompts training cannot draw. `train_env`: the
    training environment, where it was built already."""
    from prl.evaluation.sets import EvalSetError, check_held_out as check

    try:
        check(recipe, tokenizer, train_env)
    except EvalSetError as e:
        raise RecipeError(f"{e}; nothing was started") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's environment or dataset: named in one line
        raise RecipeError(f"eval: the eval sets cannot be built as the run builds them: {described(e)}; nothing was "
                          f"started") from None



def warn_scan(recipe: Recipe, console: Console) -> None:
    """Where training draws past the prompts an eval set is compared with, one line per set."""
    from prl.evaluation.sets import scan_warnings

    for line in [*scan_warnings(recipe), *prompt_warnings(recipe)]:
        console.print(f"prl run: warning: {line}", style="yellow", markup=False, highlight=False)


def prompt_warnings(recipe: Recipe) -> list[str]:
    """Characters of the first examples' prompts the run's tokenizer does not know (they become its unknown token)."""
    from prl.tasks import make_task
    from prl.tasks.prompts import unknown_characters

    tokenizer = local_tokenizer(recipe)
    if tokenizer is None:
        return []
    try:
        task = make_task(recipe.task, recipe.run.seed)
        firsts = task.dataset_fn.first_rows() if recipe.task.data is not None else [task.example(i) for i in range(8)]
        chars = unknown_characters(tokenizer, [e["prompt"] for e in firsts])
    except Exception:  # noqa: BLE001 - the task's own problems are refused by its checks, not warned about here
        return []
    if not chars:
        return []
    shown = " ".join(repr(c) for c in chars[:12]) + (" ..." if len(chars) > 12 else "")
    return [f"task: the first examples' prompts hold characters the tokenizer does not know, which the model sees as "
            f"{tokenizer.unk_token}: {shown}"]


def try_task(cfg, seed: int, key: str, index: int, tokenizer=None) -> None:
    from prl.tasks import make_task

    try:
        task = make_task(cfg, seed)
        firsts = task.dataset_fn.first_rows() if cfg.data is not None else [task.example(index)]
    except ValueError as e:
        raise RecipeError(f"invalid {key}, nothing was started: {e}") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's dataset function: named in one line
        raise RecipeError(f"invalid {key}, nothing was started: task {cfg.name!r}, example {index}: {described(e)}") from None
    try:  # the user's own reward: whatever it raises, or a value outside [0, 1], is named in one line
        for example in firsts:
            for completion in ("", str(example.get("answer", ""))):
                task.reward(completion, example)
    except (Exception, SystemExit) as e:  # noqa: BLE001
        raise RecipeError(f"invalid {key}, nothing was started: task {cfg.name!r}, its reward on example {index} "
                          f"(an empty completion, then its answer): {described(e)}") from None
    if tokenizer is not None:
        check_prompts(task, firsts, tokenizer, key)


def check_prompts(task, examples: list[dict], tokenizer, key: str) -> None:
    """The examples' prompts render (the chat template, the system prompt); a dataset file whose first rows are all
    longer than `task.max_prompt_tokens` is refused (the run would skip every row)."""
    from prl.tasks.prompts import PromptError

    try:
        lengths = [len(task.prompt_ids(tokenizer, e["prompt"])) for e in examples]
    except PromptError as e:
        raise RecipeError(f"invalid {key}, nothing was started: {e}") from None
    cap = task.max_prompt_tokens
    if cap is not None and min(lengths) > cap:
        raise RecipeError(f"invalid {key}, nothing was started: the first {len(lengths)} rows' prompts are "
                          f"{min(lengths)}-{max(lengths)} tokens, all longer than task.max_prompt_tokens = {cap} "
                          f"(longer rows are skipped): raise it")


def check_sft_data(recipe: Recipe, tokenizer) -> None:
    """`sft.data` opens, its first rows hold the keys, and they render as the warm start renders them."""
    if recipe.sft.data is None or not recipe.sft.steps_for(recipe.model):
        return
    from prl.envs.sft_data import check_sft_file
    from prl.tasks.files import open_source

    try:
        if tokenizer is None:  # the model's folder is elsewhere: the file opens, its rows wait for the trainer
            open_source(recipe.sft.data, None, False)
        else:
            check_sft_file(recipe.sft, recipe.task, tokenizer)
    except ValueError as e:
        raise RecipeError(f"invalid sft.data, nothing was started: {e}") from None


def check_env(recipe: Recipe) -> None:
    """The environment's tools import, and model-written code has a sandbox here (on a cluster the
    preflight and `prl doctor` try it on the sandbox workers' hosts)."""
    from prl.envs.tools import load_tool

    try:
        for env in [recipe.env, *(ev.env for ev in recipe.eval.values() if ev.env is not None)]:
            for spec in env.tools:
                load_tool(spec)
    except ValueError as e:
        raise RecipeError(f"invalid environment, nothing was started: {e}") from None
    if env_class(recipe.env.kind).needs_sandbox and recipe.cluster is None:
        from prl.sandbox import SandboxUnavailable, check

        try:
            check(recipe.env.sandbox.isolation)
        except SandboxUnavailable as e:
            raise RecipeError(f"env.sandbox.isolation = {recipe.env.sandbox.isolation!r}: {e}; nothing was "
                              f"started") from None


def prepare_new(recipe: Recipe, run_dir: Path, force: bool) -> None:
    if run_dir.exists():
        if not force:
            raise RunStopped(f"{run_dir} exists: pass --resume {run_dir} to continue it, or --force to start over")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "recipe.json").write_text(recipe.model_dump_json(indent=1))
    from prl.model.pretrained import PretrainedError
    from prl.model.tiny import write_model_dir

    try:
        write_model_dir(recipe.model, run_dir / "model")
    except PretrainedError as e:  # on a cluster the folder is read here too: the run's model folder links it
        shutil.rmtree(run_dir)
        raise RecipeError(f"model.path: {e} on this machine (the run's model folder is made here from it, even "
                          f"when the hosts hold their own copy); nothing was started") from None


def load_resume(run_dir: Path, overrides: list[str]) -> Recipe:
    """The run's recipe plus `--set` overrides (e.g. more steps), validated and checked; writes nothing."""
    source = run_dir / "recipe.json"
    if not source.is_file():
        raise RunStopped(f"{run_dir}: not a prl run directory (no recipe.json); `prl runs` lists the runs")
    try:
        data = json.loads(source.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunStopped(f"{source}: unreadable ({type(e).__name__}: {e}); the run cannot be resumed") from None
    for item in overrides:
        apply_override(data, item)
    inherit_eval_tables(data)  # an eval set's env or task a --set gave starts from the recipe's
    given = set_keys(overrides)
    return checks.checked(validate(data, str(source), set_keys=given), str(source), given)


def prepare_resume(run_dir: Path, recipe: Recipe) -> None:
    """Once every check passed: record the recipe (with its overrides) and drop what was produced
    after the last checkpoint."""
    (run_dir / "recipe.json").write_text(recipe.model_dump_json(indent=1))
    steps = sealed(run_dir / "checkpoints", "step_")
    last = steps[-1] if steps else -1
    for v in published_versions(run_dir / "weights"):
        if v > last:
            shutil.rmtree(version_dir(run_dir / "weights", v), ignore_errors=True)
    for v in sealed(run_dir / "checkpoints", WEIGHTS_PREFIX):  # eval sets' snapshots the run makes again
        if v > last:
            shutil.rmtree(run_dir / "checkpoints" / f"{WEIGHTS_PREFIX}{v}", ignore_errors=True)
    for p in (run_dir / "rollouts").glob("step_*.pt"):
        p.unlink()
    from prl.trainer.ledger import truncate

    truncate(run_dir, last)


def start_run(recipe: Recipe, run_dir: Path, console: Console, resume: bool = False) -> Supervisor:
    """The run's processes bound to their hosts; for a cluster, after checks, provisioning, staging."""
    if recipe.cluster is not None:
        from prl.launch.cluster import launch

        return launch(recipe, run_dir, console, resume)
    configs = resolve(recipe, run_dir, write_secret(run_dir))
    write_configs(configs, run_dir)
    shutil.rmtree(run_dir / PORTS, ignore_errors=True)  # where an earlier session's processes listened
    return Supervisor(make_plan(configs, run_dir), {"local": LocalHost()}, run_dir)


def execute(recipe: Recipe, run_dir: Path, console: Console, tui: bool, resume: bool = False) -> Outcome:
    try:
        sink = WandbSink(recipe, run_dir, resume) if recipe.run.wandb else None
    except WandbError as e:
        return Outcome("failed", f"{e}; nothing was started", 2)
    outcome = Outcome("failed", "the driver stopped before the run ended", 1)
    try:
        try:
            sup = start_run(recipe, run_dir, console, resume)
        except (HostError, RuntimeError) as e:  # LaunchError, ProvisionError: nothing was started
            outcome = Outcome("failed", str(e), 2)
            return outcome
        try:
            outcome = supervise(sup, recipe, run_dir, console, tui, sink)
            return outcome
        finally:
            sup.close()
    finally:
        if sink:
            sink.close(outcome.state, outcome.code)


def supervise(sup: Supervisor, recipe: Recipe, run_dir: Path, console: Console, tui: bool,
              sink: WandbSink | None = None) -> Outcome:
    log = EventLog(run_dir / "metrics.jsonl", "driver")
    log.emit("run", state="running", name=recipe.run.name, started=time.time(), max_steps=recipe.rl.max_steps,
             pid=os.getpid(), hosts=sorted({p.spec.host for p in sup.procs.values()}))
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    # a shell may start us with SIGINT ignored (background job); Ctrl-C must still stop the run
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sup.start_all()
        for p in sup.procs.values():
            log.emit("process", name=p.spec.name, role=p.spec.role, host=p.spec.host, pid=p.pid, state="running")
        faults = Faults(sup, log, recipe.run.max_restarts, recipe.run.hang_timeout_s)
        faults.mark_started()
        outcome = watch(sup, run_dir, log, console, tui, faults, sink)
    except (KeyboardInterrupt, RunStopped) as e:
        outcome = Outcome("interrupted", f"interrupted ({type(e).__name__}); stopping every process", 130)
    except HostError as e:
        outcome = Outcome("failed", f"lost a host: {e}; stopping every process", 1)
    finally:
        for s in previous:  # a second Ctrl-C must not cut the teardown short
            signal.signal(s, signal.SIG_IGN)
        problems = sup.stop_all()
        for s, h in previous.items():
            signal.signal(s, h)
    if problems:
        outcome.message += "\nteardown problems (check these hosts by hand):\n  " + "\n  ".join(problems)
    for name, p in sup.procs.items():
        if name != outcome.failed:
            log.emit("process", name=name, state="done" if p.poll() == 0 else "stopped")
    log.emit("run", state=outcome.state, message=outcome.message, ended=time.time())
    return outcome


def _raise_stop(signum, frame):
    raise RunStopped(signal.Signals(signum).name)


def watch(sup: Supervisor, run_dir: Path, log: EventLog, console: Console, tui: bool, faults: Faults,
          sink: WandbSink | None = None) -> Outcome:
    state = RunState()
    metrics = run_dir / "metrics.jsonl"
    state.update_from(metrics)
    live = Live(render(state), console=console, refresh_per_second=4) if tui else None
    # notices from this launch on (a resumed run's log holds the earlier ones)
    printed, poll, curves = {"sft": -1, "rl": -1, "since": state.run.get("started", 0.0)}, Poll(), False
    with KeyReader() if tui else contextlib.nullcontext() as keys:
        try:
            if live:
                live.start()
            while True:
                outcome = poll_exits(sup, log, poll, faults)
                state.update_from(metrics)
                faults.check_hangs(state, hosts_answering=poll.lost_since is None)
                if sink:
                    sink.poll()
                if live:
                    curves ^= "c" in keys.pressed()  # the key `c` shows or hides the whole-run curves
                    live.update(render(state, curves, console.width, hint=f"c: {'hide' if curves else 'show'} curves"))
                else:
                    for line in progress_lines(state, printed):
                        console.print(line, markup=False, highlight=False)
                if outcome:
                    return outcome
                time.sleep(0.2)
        finally:
            if live:
                live.stop()


@dataclass
class Poll:
    last: float = 0.0
    lost_since: float | None = None  # when the hosts stopped answering


def poll_exits(sup: Supervisor, log: EventLog, poll: Poll, faults: Faults) -> Outcome | None:
    """Stream remote logs and metrics and look for exited processes. Remote hosts are asked at most
    twice a second; an SSH hiccup is retried until the hosts' watchdogs would give up."""
    if sup.remote and time.monotonic() - poll.last < 0.5:
        return None
    try:
        if sup.remote:
            sup.sync()
        outcome = check_exits(sup, log, faults)
    except HostError as e:
        if poll.lost_since is None:
            poll.lost_since = time.monotonic()
            log.emit("error", name="driver", line=f"host not answering, retrying: {e}")
        if time.monotonic() - poll.lost_since > (sup.heartbeat_s or 0):
            raise
        return None
    poll.last, poll.lost_since = time.monotonic(), None
    return outcome


def progress_lines(s: RunState, printed: dict) -> list[str]:
    """Without the dashboard: a line per tenth of the warm start, then one per RL step, each once (a step a restarted
    trainer replays is not printed again; `printed`: the last step of each stage printed)."""
    out = []
    while s.steps:
        e = s.steps.popleft()
        if e["kind"] != "trainer_step":
            out += notice_line(e) if e.get("t", 0.0) >= printed.get("since", 0.0) else []
            continue
        stage, step = ("sft", e["step"]) if e.get("stage") == "sft" else ("rl", e["step"])
        if step <= printed[stage]:
            continue
        printed[stage] = step
        if stage == "sft":
            if (step + 1) % max(1, e["total"] // 10) == 0 or step + 1 == e["total"]:
                out.append(f"warm start {step + 1}/{e['total']}  loss {e.get('loss', 0):.4f}")
        else:
            out.append(step_line(e, s))
    return out


def notice_line(e: dict) -> list[str]:
    """A start-up or fault event as a line of the plain output (none for a process that ended well)."""
    kind, name = e["kind"], e.get("name", "")
    if kind == "process" and e.get("state") == "running":
        return [f"{name}: started (pid {e.get('pid')} on {e.get('host')})"]
    if kind == "process" and e.get("state") == "failed":
        return [f"{name}: exited with code {e.get('exit_code')}"]
    if kind == "orchestrator":
        return [f"orchestrator: {e['state']}" + (f" (step {e['step']})" if e.get("step") else "")]
    if kind == "server_state":
        return [f"{name}: {e['state']}" + (f" ({e['cause']})" if e.get("cause") else "")]
    if kind == "restart":
        return [f"{name}: restart {e['count']} of {e['max_restarts']} ({e['cause']})"]
    return []


def step_line(tr: dict, s: RunState) -> str:
    reward = s.rewards.get(tr["step"])
    return (f"step {tr['step'] + 1}/{tr['total']}  reward {'-' if reward is None else f'{reward:.3f}'}  "
            f"loss {tr.get('loss', 0):.4f}  mismatch_kl {tr.get('mismatch_kl', 0):.2e}  version {tr.get('version')}  "
            f"stale_dropped {s.orch.get('stale_dropped_total', 0)}")


def check_exits(sup: Supervisor, log: EventLog, faults: Faults) -> Outcome | None:
    for name, rc in sup.exited().items():
        p = sup.procs[name]
        if p.code is None:
            continue  # restarted meanwhile, with the rest of its unit
        if rc == 0 and p.spec.role == "trainer" and name in ("trainer", "trainer-0"):
            # the endpoint's node: it waited for the orchestrator
            return Outcome("finished", "the trainer ended its last step", 0)
        if rc == 0 and p.spec.role == "trainer":
            continue  # another trainer node, done with its ranks
        if rc == 0 and p.spec.role == "orchestrator":
            continue  # shipped every batch; the trainer finishes the last steps
        log.emit("process", name=name, state="failed", exit_code=rc)
        with contextlib.suppress(HostError):  # the freshest lines, if its host still answers
            p.pull_log()
        since = faults.started.get(faults.unit(name), 0.0)
        line = user_error(log.path, since)
        if line is not None:  # the user's code failed: restarting would fail the same way
            written = log.path.parent / "user_error.json"
            fresh = written.is_file() and written.stat().st_mtime >= since
            where = f"; the example and its traceback: {written}" if fresh else ""
            dropping = "env.max_error_share" in line or "(reward_dropped)" in line  # dropping already
            hint = " (env.on_error = 'drop' drops such examples instead)" if p.spec.role == "orchestrator" and \
                not dropping else ""
            return Outcome("failed", f"{line}{where}{hint}", 1, failed=name)
        why = exit_reason(rc)
        try:
            if faults.restart(name, f"{name} {why}"):
                continue
        except RestartFailed as e:
            return Outcome("failed", f"{e}; stopping every process", 1, failed=name)
        tail = "\n".join(f"    {ln}" for ln in p.tail(15))
        return Outcome("failed", f"{name} ({p.spec.role} on host {p.spec.host}, pid {p.pid}) {why}"
                                 f"{faults.exhausted(name)}; last log lines ({p.spec.log}):\n{tail}", 1, failed=name)
    return None


def user_error(metrics: Path, since: float) -> str | None:
    """The line of the user's error a process logged since `since` (its unit's start), if it ended on one."""
    events, _ = read_events(metrics)
    return next((e["line"] for e in reversed(events) if e.get("kind") == "error" and e.get("user")
                 and e.get("t", 0.0) >= since), None)


def exit_reason(rc: int) -> str:
    if rc == NO_STATUS:
        return "was killed (no exit status)"
    if rc == 0:
        return "exited before the run finished"
    sig = -rc if rc < 0 else rc - 128 if rc > 128 else 0
    names = {s.value: s.name for s in signal.Signals}
    return f"exited with code {rc}" + (f" (killed by {names[sig]})" if sig in names else "")


def finish(run_dir: Path, outcome: Outcome, console: Console, wall_s: float) -> None:
    state = RunState().update_from(run_dir / "metrics.jsonl")
    summary = {**summarize(state), "state": outcome.state, "wall_s": round(wall_s, 1)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    style = "green" if outcome.code == 0 else "red"
    console.print(f"prl run: {outcome.state}: {outcome.message}", style=style, markup=False, highlight=False)
    if summary["rl_steps"]:
        console.print(
            f"reward: first 5 RL steps {summary['first5_reward']:.3f}, last 5 {summary['last5_reward']:.3f} "
            f"({summary['improvement']:+.3f}) over {summary['rl_steps']} steps in {wall_s:.0f}s; "
            f"summary in {run_dir / 'summary.json'}", markup=False, highlight=False,
        )
    from prl.tui.evals import eval_line

    for name, s in summary.get("eval", {}).items():
        console.print(f"eval {name}: {eval_line(s)}", markup=False, highlight=False)


def run(recipe: Recipe | None, *, resume: Path | None, overrides: list[str], force: bool, tui: bool,
        console: Console) -> int:
    t0 = time.time()
    try:
        if resume:  # every check before anything is written: a refused resume leaves the run as it was
            run_dir = Path(resume)
            recipe = load_resume(run_dir, overrides)
            refuse_not_built(recipe)
            preflight(recipe)
            prepare_resume(run_dir, recipe)
        else:
            run_dir = run_dir_for(recipe)
            refuse_not_built(recipe)
            preflight(recipe)
            prepare_new(recipe, run_dir, force)
    except (RunStopped, RecipeError) as e:
        console.print(f"prl run: {e}", style="red", markup=False, highlight=False)
        return 2
    warn_scan(recipe, console)
    console.print(f"prl run: {recipe.run.name} -> {run_dir}  (logs in {run_dir / 'logs'})", markup=False)
    outcome = execute(recipe, run_dir, console, tui and sys.stdout.isatty(), resume=resume is not None)
    finish(run_dir, outcome, console, time.time() - t0)
    return outcome.code

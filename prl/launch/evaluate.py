"""`prl eval`: a recipe's eval sets on a run's checkpoint or on a model folder, outside any run.

The weights become a model folder (a checkpoint is exported as `prl ckpt export --merged` writes it), the
recipe's inference processes start on it (embedded engine or vLLM, as the recipe says; sandbox
workers where the environment runs code), and the sets run through the same pool, environment and
runner as inside a run (`prl.orchestrator.evals`), every example at once, with the same seeds. The
servers serve the weights they started with, so every token is theirs (`later_share` 0).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
from pathlib import Path

from prl.recipe.schema import Recipe

SERVING_ROLES = ("inference", "engine_worker", "kv_master", "sandbox")
WORK_MARK = "prl-eval"  # in a folder prl eval made (and may delete to start over)


class EvalError(RuntimeError):
    """What `prl eval` cannot do, in one line."""


def checkpoint_model(run_dir: Path, step: str, out: Path) -> tuple[Path, int]:
    """The run's checkpoint at `step` ("latest" or a number) as a model folder in `out`, and its step."""
    from prl.trainer.export import ExportError, export, find_checkpoint

    try:
        path = find_checkpoint(run_dir, step)
        number = int(path.name.rpartition("_")[2])
        if out.exists():
            shutil.rmtree(out)
        export(run_dir, str(number), out, merged=True)  # a LoRA checkpoint: its adapters merged into the base
    except ExportError as e:
        raise EvalError(str(e)) from None
    return out, number


def evaluate(recipe: Recipe, model_dir: Path, work_dir: Path, only: list[str]) -> dict[str, dict]:
    """Each chosen set's figures on the weights in `model_dir`; `work_dir` holds the processes' logs."""
    from prl.launch.driver import RecipeError, preflight, prepare_new

    serving = serving_recipe(recipe, model_dir, work_dir, only)
    try:
        preflight(serving)
        prepare_new(serving, work_dir, force=True)
    except RecipeError as e:
        raise EvalError(str(e)) from None
    (work_dir / WORK_MARK).write_text("prl eval's servers, logs and result\n")
    return serve_and_score(serving, work_dir)


def serving_recipe(recipe: Recipe, model_dir: Path, work_dir: Path, only: list[str]) -> Recipe:
    """The recipe `prl eval` starts its processes with: the weights in `model_dir`, the chosen sets, `work_dir`
    as its folder, and the run's warm-start steps kept (with `model.path` set, unset `sft.steps` would mean
    none), so its sets leave out the prompts the run's left out and hold the same examples."""
    sets = {name: ev for name, ev in recipe.eval.items() if not only or name in only}
    return recipe.model_copy(update={"model": recipe.model.model_copy(update={"path": str(model_dir)}),
                                     "sft": recipe.sft.model_copy(update={"steps": recipe.sft.steps_for(recipe.model)}),
                                     "eval": sets,
                                     "run": recipe.run.model_copy(update={"name": work_dir.name,
                                                                          "output_dir": str(work_dir.parent),
                                                                          "wandb": None})})


def serve_and_score(recipe: Recipe, work_dir: Path) -> dict[str, dict]:
    """Start the recipe's serving processes, score its sets, stop them whatever happens."""
    sup, orch_cfg = serving(recipe, work_dir)
    previous = {s: signal.signal(s, stopped) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        sup.start_all()
        return asyncio.run(score(orch_cfg, sup))
    finally:
        for s in previous:  # a second signal must not cut the teardown short
            signal.signal(s, signal.SIG_IGN)
        sup.stop_all()
        sup.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def serving(recipe: Recipe, work_dir: Path):
    """The recipe's serving processes (a `Supervisor`, not started) and the config of the orchestrator that
    scores on them."""
    from prl.launch.hosts import LocalHost
    from prl.launch.processes import make_plan
    from prl.launch.supervisor import Supervisor
    from prl.launch.configs import resolve
    from prl.recipe.resolve import write_configs, write_secret

    configs = resolve(recipe, work_dir, write_secret(work_dir))
    write_configs(configs, work_dir)
    specs = [s for s in make_plan(configs, work_dir) if s.role in SERVING_ROLES]
    return Supervisor(specs, {"local": LocalHost()}, work_dir), next(c for c in configs if c.role == "orchestrator")


def stopped(signum, frame):
    raise EvalError(f"stopped by {signal.Signals(signum).name}; the servers were stopped")


async def score(cfg, sup) -> dict[str, dict]:
    from prl.backends.base import BackendError
    from prl.envs import SkipExample
    from prl.evaluation.runner import run_set
    from prl.orchestrator.orchestrator import Orchestrator

    orch = Orchestrator(cfg)
    watch = asyncio.create_task(exits(sup))
    monitors = []
    try:
        try:
            await until_exit(orch.pool.start(cfg.startup_timeout_s), watch)
        except BackendError as e:
            raise EvalError(f"no inference server came up: {e}") from None
        monitors = [asyncio.create_task(orch.pool.watch(s)) for s in orch.pool.servers]  # a server taken out rejoins
        results = {}
        for s in orch.evals.sets.values():  # one set at a time, every example of it at once
            try:
                figures = await until_exit(run_set(s, orch.eval_sampler, asyncio.Semaphore(s.examples), None), watch)
            except SkipExample as e:  # every example skipped
                raise EvalError(str(e)) from None
            results[s.name] = {**figures, "examples": s.examples, "samples": s.cfg.samples,
                               "verbatim_share": s.verbatim_share, "replaced": s.replaced}
        return results
    finally:
        for task in (watch, *monitors):
            task.cancel()
        await asyncio.gather(watch, *monitors, return_exceptions=True)
        await orch.stop()


async def until_exit(work, watch: asyncio.Task):
    """The result of the coroutine `work`, or the EvalError `watch` raises when a serving process exits
    first; either way `work` has ended when this returns (cancelled, with the tasks it started), so
    nothing of it runs on while the servers are stopped."""
    task = asyncio.create_task(work)
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        return await (task if task.done() else watch)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def exits(sup) -> None:
    """Raise EvalError when a serving process exits (its log's last lines say why)."""
    from prl.launch.driver import exit_reason

    while True:
        for name, rc in sup.exited().items():
            p = sup.procs[name]
            tail = "\n    ".join(p.tail(8))
            raise EvalError(f"{name} {exit_reason(rc) if rc else 'exited'} before the eval ended; its log {p.spec.log}:\n    {tail}")
        await asyncio.sleep(0.5)


def target(run_dir: Path | None, model: Path | None, recipe_path: Path | None, step: str,
           overrides: list[str]) -> tuple[Recipe, Path, Path, int | None]:
    """(recipe, model folder, work folder, checkpoint step) of what `prl eval` was asked to score; EvalError
    naming what is wrong (nothing is started or written before every check passed)."""
    from prl.launch.checks import load
    from prl.launch.driver import RunStopped, load_resume
    from prl.recipe import RecipeError

    if (run_dir is None) == (model is None):
        raise EvalError("give a run directory (prl eval runs/NAME --step N) or --model HF_DIR --recipe RECIPE")
    try:
        if run_dir is not None:
            if recipe_path is not None:
                raise EvalError(f"a run is scored with its own recipe ({run_dir}/recipe.json); change keys with --set")
            fixed = next((o for o in overrides if o.strip().startswith("model.")), None)
            if fixed is not None:
                raise EvalError(f"--set {fixed.partition('=')[0].strip()}: a run's checkpoint holds the run's model, "
                                f"which no key changes (score another folder with --model DIR --recipe RECIPE)")
            recipe = load_resume(run_dir, overrides)
        else:
            if recipe_path is None:
                raise EvalError("--model needs --recipe: the recipe's [eval.<name>] sets and inference say what to run")
            if not model.is_dir():
                raise EvalError(f"--model {model}: no such folder (give a Hugging Face model folder)")
            recipe = load(recipe_path, overrides)
    except (RunStopped, RecipeError) as e:
        raise EvalError(str(e)) from None
    if not recipe.eval:
        raise EvalError("the recipe has no eval set: add an [eval.<name>] table (docs/evaluation.md), or --set "
                        "eval.heldout.examples=32")
    if recipe.cluster is not None:
        raise EvalError("prl eval starts its servers on this machine: score a [cluster] run's checkpoint with a "
                        "recipe without [cluster] (copy checkpoints/ here, or run prl eval on a GPU host)")
    if run_dir is None:
        work = Path(recipe.run.output_dir).resolve() / "evals" / recipe.run.name
        if work.exists() and not (work / WORK_MARK).is_file():
            raise EvalError(f"{work} exists and is not a prl eval folder: set run.output_dir or run.name elsewhere")
        return recipe, model.resolve(), work, None
    from prl.trainer.export import ExportError, find_checkpoint

    try:
        number = int(find_checkpoint(run_dir, step).name.rpartition("_")[2])
    except ExportError as e:
        raise EvalError(str(e)) from None
    evals = run_dir.resolve() / "evals"
    return recipe, evals / f"model_step_{number}", evals / f"step_{number}", number


def run_eval(run_dir: Path | None, model: Path | None, recipe_path: Path | None, step: str, only: list[str],
             overrides: list[str]) -> dict:
    """`prl eval`: every chosen set's figures, as {"step", "model", "sets": {name: figures}}."""
    recipe, model_dir, work_dir, number = target(run_dir, model, recipe_path, step, overrides)
    unknown = [name for name in only if name not in recipe.eval]
    if unknown:
        raise EvalError(f"--only {unknown[0]}: no such eval set; the recipe's: {', '.join(recipe.eval)}")
    if number is not None:
        checkpoint_model(run_dir, str(number), model_dir)
    sets = evaluate(recipe, model_dir, work_dir, only)
    (work_dir / "result.json").write_text(json.dumps({"step": number, "model": str(model_dir), "sets": sets}, indent=1))
    return {"step": number, "model": str(model_dir), "sets": sets}

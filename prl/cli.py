"""The `prl` command. Each command parses, then imports the heavy code it needs."""

from __future__ import annotations

import atexit
import gc
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console


def _freeze_at_exit() -> None:
    """Every object out of the collector's passes as the interpreter ends: its teardown then frees them without
    tracing them (`prl run` itself exited 0.25 s after its last line, 0.03 s this way). Not once Triton is loaded
    (transformers' modeling code imports it through torch's compiler): its bindings would report their frozen
    objects as leaked on stderr."""
    if "triton" not in sys.modules:
        gc.freeze()


atexit.register(_freeze_at_exit)

HELP = {"help_option_names": ["-h", "--help"]}
# rich_markup_mode=None: help texts name TOML tables ([cluster]) that rich markup would swallow
app = typer.Typer(help="prl: asynchronous RL for LLMs, mixture-of-experts first.", no_args_is_help=True,
                  pretty_exceptions_enable=False, rich_markup_mode=None, context_settings=HELP)
ckpt_app = typer.Typer(help="Checkpoint tools.", no_args_is_help=True, rich_markup_mode=None, context_settings=HELP)
app.add_typer(ckpt_app, name="ckpt")
sandbox_app = typer.Typer(help="Run code in the sandbox model-written code runs in.", no_args_is_help=True,
                          rich_markup_mode=None, context_settings=HELP)
app.add_typer(sandbox_app, name="sandbox")
console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def fail(command: str, message: str, code: int = 2) -> typer.Exit:
    """One line (or a few, for a recipe's errors) naming what is wrong; the exit to raise."""
    err.print(f"prl {command}: {message}", markup=False, highlight=False)
    return typer.Exit(code)


def _version(value: bool) -> None:
    if value:
        from prl import __version__

        console.print(f"prl {__version__}", markup=False, highlight=False)
        raise typer.Exit(0)


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="print prl's version and exit")):
    """prl: asynchronous RL for LLMs, mixture-of-experts first."""
    # a recipe's own modules (task.dataset, env.kind = "my_module:MyEnv") import from where prl runs, from
    # the `prl` console script as with `python -m prl` (which puts the working directory on the path)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


@app.command()
def run(
    recipe: Optional[Path] = typer.Argument(None, help="the TOML recipe"),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="override a key, e.g. --set trainer.lr=1e-5"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print every key of the resolved recipe and the process "
                                                          "plan, then exit"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="continue RUN_DIR from its last checkpoint, with "
                                                                 "the recipe it was started with (plus --set)"),
    force: bool = typer.Option(False, "--force", help="delete an existing run directory of the same name"),
    no_tui: bool = typer.Option(False, "--no-tui", help="plain step lines instead of the live dashboard"),
):
    """Validate a recipe, start every process, train, stream the dashboard, stop cleanly."""
    from prl.launch.checks import load
    from prl.recipe import RecipeError

    loaded = None
    if resume is not None and recipe is not None:
        raise fail("run", f"give RECIPE or --resume RUN_DIR, not both: a resumed run keeps the recipe it was started "
                          f"with ({resume}/recipe.json); change keys with --set")
    if resume is None:
        if recipe is None:
            raise fail("run", "give a recipe (prl run recipes/reverse-tiny.toml) or --resume RUN_DIR")
        try:
            loaded = load(recipe, set_)
        except RecipeError as e:
            raise fail("run", f"invalid recipe, nothing was started\n{e}") from None
    from prl.launch import driver

    if dry_run:
        if resume is not None:
            try:
                loaded = driver.load_resume(resume, set_)
            except (driver.RunStopped, RecipeError) as e:
                raise fail("run", str(e)) from None
        raise typer.Exit(driver.dry_run(loaded, console, resume))
    raise typer.Exit(driver.run(loaded, resume=resume, overrides=set_, force=force, tui=not no_tui, console=console))


@app.command()
def stop(
    run_dir: Path = typer.Argument(..., help="the run directory of a running run, e.g. runs/reverse-tiny"),
    timeout: float = typer.Option(300.0, "--timeout", help="seconds to wait for every process to stop"),
):
    """Stop a running run cleanly from another terminal (what Ctrl-C does in its own): every process
    stops, the run is recorded as stopped, and `prl run --resume RUN_DIR` continues it."""
    from prl.launch.runs import RunsError
    from prl.launch.runs import stop as stop_run

    try:
        stop_run(run_dir, timeout, say=lambda line: console.print(line, markup=False, highlight=False))
    except RunsError as e:
        raise fail("stop", str(e)) from None
    console.print(f"prl stop: {run_dir} stopped", markup=False, highlight=False)


@app.command()
def runs(directory: Path = typer.Argument(Path("runs"), help="where runs are (run.output_dir; default runs/)")):
    """List the runs under DIRECTORY: name, state, RL steps, last reward, start time."""
    from prl.launch.runs import RunsError, format_runs, runs_table

    try:
        rows = runs_table(directory)
    except RunsError as e:
        raise fail("runs", str(e)) from None
    if not rows:
        console.print(f"prl runs: no runs under {directory}", markup=False, highlight=False)
        return
    console.print(format_runs(rows), markup=False, highlight=False)


@app.command()
def keys(section: Optional[str] = typer.Argument(None, help="one table, e.g. trainer or trainer.loss")):
    """Every recipe key: its type, default (or required), allowed values and what it does (Markdown;
    docs/recipe-reference.md is this output)."""
    from prl.recipe.reference import keys_text

    try:
        text = keys_text(section)
    except (KeyError, ValueError) as e:
        raise fail("keys", str(e.args[0] if e.args else e)) from None
    if sys.stdout.isatty():  # Markdown escapes `<name>` in headings for HTML; a terminal shows it as written
        text = text.replace("&lt;", "<").replace("&gt;", ">")
    print(text, end="")


@app.command()
def plan(
    recipe: Path = typer.Argument(..., help="the TOML recipe"),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="override a key, e.g. --set plan.mfu=0.4"),
):
    """Per-GPU memory of the trainer and inference servers and a step-time estimate, before launch;
    exits 1 naming what does not fit. Assumptions are the recipe's [plan] keys."""
    from prl.launch.checks import load
    from prl.recipe import RecipeError
    from prl.sizing.estimate import make_plan
    from prl.sizing.report import format_plan

    try:
        loaded = load(recipe, set_)
        result = make_plan(loaded)
    except (RecipeError, ValueError) as e:
        err.print(f"prl plan: {e}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    console.print(format_plan(loaded, result), markup=False, highlight=False)
    raise typer.Exit(1 if result.problems else 0)


@app.command()
def doctor(recipe: Path = typer.Argument(..., help="the TOML recipe")):
    """Check that the recipe can run: with [cluster], every host in parallel; without, this machine (the
    same checks as `prl run --dry-run`: vLLM, the sandbox, Mooncake, the model folder, the task).
    A non-zero exit names each failure."""
    from prl.launch.checks import load
    from prl.recipe import RecipeError

    try:
        loaded = load(recipe)
    except RecipeError as e:
        raise fail("doctor", f"invalid recipe\n{e}") from None
    if loaded.cluster is None:
        from prl.launch.local_doctor import check_local

        failures = check_local(loaded, console)
        for line in failures:
            err.print(f"prl doctor: {line}", markup=False, highlight=False)
        raise typer.Exit(1 if failures else 0)
    from prl.launch.doctor import check_cluster, report, role_needs
    from prl.launch.placement import links_needed, ports_needed
    from prl.launch.configs import resolve

    configs = resolve(loaded, Path(loaded.run.output_dir) / loaded.run.name)
    results = check_cluster(loaded.cluster, console, ports_needed(configs, loaded), links_needed(configs, loaded),
                            needs=role_needs(loaded), model_path=loaded.model.path)
    failures = report(results, console)
    for line in failures:
        err.print(f"prl doctor: {line}", markup=False, highlight=False)
    raise typer.Exit(1 if failures else 0)


@app.command()
def status(
    run_dirs: list[Path] = typer.Argument(..., help="a run directory, e.g. runs/reverse-tiny; several: curves overlaid"),
    watch: bool = typer.Option(False, "--watch", help="refresh until interrupted"),
    curves: bool = typer.Option(False, "--curves", help="add the whole-run curves (reward, loss, KL, lag, throughput)"),
    as_json: bool = typer.Option(False, "--json", help="print the state of each run as one JSON object a line"),
):
    """Show a run's dashboard snapshot from its directory (while it runs or after); compare runs."""
    if as_json:
        import json

        from prl.launch.runs import RunsError, status_json

        try:
            lines = [json.dumps(status_json(d)) for d in run_dirs]
        except RunsError as e:
            raise fail("status", str(e)) from None
        print("\n".join(lines))
        return
    from prl.tui.status import show

    raise typer.Exit(show(run_dirs, watch, console, curves))


@app.command()
def report(
    run_dirs: list[Path] = typer.Argument(..., help="one or more run directories (several: overlaid)"),
    out: Path = typer.Option(Path("report.html"), "--out", help="the HTML file to write"),
):
    """Write one self-contained HTML report (curves, step time, servers, restarts, recipe) of runs,
    and PNGs of its curves beside it (OUT_STEM_png/)."""
    from prl.report import ReportError, write_report

    try:
        path = write_report(run_dirs, out)
    except ReportError as e:
        raise fail("report", str(e)) from None
    except OSError as e:
        raise fail("report", f"--out {out}: cannot be written ({e.strerror}); give the path of an HTML file") from None
    console.print(f"wrote {path} and PNGs of its curves in {path.parent / (path.stem + '_png')}", markup=False)


@app.command()
def samples(
    run_dir: Path = typer.Argument(..., help="a run directory, e.g. runs/reverse-tiny"),
    step: str = typer.Option("latest", "--step", help="a step's number, 'latest' or 'all'"),
    worst: bool = typer.Option(False, "--worst", help="lowest reward first"),
    best: bool = typer.Option(False, "--best", help="highest reward first"),
    grep: Optional[str] = typer.Option(None, "--grep", help="only samples whose prompt or completion holds TEXT"),
    eval_set: Optional[str] = typer.Option(None, "--eval", help="an eval set's completions instead ([eval.SET])"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object a sample"),
):
    """Print what the model wrote: the samples a run keeps of each step (run.samples_per_step), or every completion
    of an eval set (--eval SET), with their rewards."""
    import json

    from prl.launch.samples import SamplesError, read_samples, select, show

    if worst and best:
        raise fail("samples", "--worst and --best: give one")
    try:
        chosen = select(read_samples(run_dir, eval_set), step, "worst" if worst else "best" if best else None, grep)
    except SamplesError as e:
        raise fail("samples", str(e)) from None
    if as_json:
        print("\n".join(json.dumps(s) for s in chosen))
        return
    if not chosen:
        console.print(f"prl samples: no sample of step {step} holds {grep!r}", markup=False, highlight=False)
        return
    console.print("\n\n".join(show(s) for s in chosen), markup=False, highlight=False)


@app.command("eval")
def eval_(
    run_dir: Optional[Path] = typer.Argument(None, help="a run directory: score one of its checkpoints"),
    step: str = typer.Option("latest", "--step", help="with RUN_DIR: a checkpoint step, or 'latest'"),
    model: Optional[Path] = typer.Option(None, "--model", help="instead of a run: a Hugging Face model folder"),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="with --model: the recipe whose eval sets and "
                                                                 "inference to use"),
    only: list[str] = typer.Option([], "--only", metavar="SET", help="score this eval set only (repeat for more)"),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="override a key, e.g. --set "
                                                                         "eval.heldout.examples=256"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object with every figure"),
):
    """Score the recipe's eval sets ([eval.<name>]) on a run's checkpoint or on a model folder: the
    recipe's inference servers start on those weights, the sets run as they do inside a run, and a
    table (or --json) of pass@k, best@k, maj@k, reward and lengths is printed."""
    from prl.launch.evaluate import EvalError, run_eval

    try:
        result = run_eval(run_dir, model, recipe, step, only, set_)
    except EvalError as e:
        raise fail("eval", str(e)) from None
    if as_json:
        import json

        print(json.dumps(result))
        return
    from prl.tui.evals import eval_record, eval_table

    records = [eval_record({"set": name, "step": result["step"] if result["step"] is not None else 0, **figures})
               for name, figures in result["sets"].items()]
    where = f"step {result['step']} of {run_dir}" if run_dir is not None else str(model)
    console.print(eval_table([r for r in records if r], title=f"prl eval: {where}", width=console.width))


@ckpt_app.command("export")
def ckpt_export(
    run_dir: Path = typer.Argument(..., help="a run directory"),
    out: Path = typer.Option(..., "--out", help="the Hugging Face folder to write"),
    step: str = typer.Option("latest", "--step", help="a checkpoint step, or 'latest'"),
    fp8: bool = typer.Option(False, "--fp8", help="block-FP8 weights (DeepSeek-V3 / GLM-5-FP8 layout)"),
    merged: bool = typer.Option(False, "--merged", help="a LoRA checkpoint: its base with the adapters merged in, a "
                                                        "whole model (without: a PEFT adapter folder)"),
):
    """Write a checkpoint as a Hugging Face folder (config.json, safetensors, tokenizer); a LoRA checkpoint as
    a PEFT adapter folder (adapter_config.json, adapter_model.safetensors), or merged with --merged."""
    from prl.trainer.export import ExportError, export

    try:
        path = export(run_dir, step, out, fp8=fp8, merged=merged)
    except ExportError as e:
        raise fail("ckpt export", str(e)) from None
    if (path / "adapter_config.json").is_file():
        console.print(f"wrote {path}: a PEFT LoRA adapter; its base is `prl ckpt export {run_dir} --step 0`, the "
                      f"merged model `prl ckpt export {run_dir} --step {step} --merged`", markup=False)
        return
    console.print(f"wrote {path}", markup=False)


@ckpt_app.command("merge")
def ckpt_merge(
    adapter: Path = typer.Argument(..., help="a PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors)"),
    base: Path = typer.Argument(..., help="the Hugging Face folder of its base model"),
    out: Path = typer.Option(..., "--out", help="the merged Hugging Face folder to write"),
):
    """Merge a PEFT LoRA adapter into its base model's weights (W + lora_alpha / r * B @ A): a whole Hugging
    Face folder, every other file of BASE copied."""
    from prl.model.peft_adapter import AdapterError, merge_adapter

    try:
        path = merge_adapter(adapter, base, out)
    except AdapterError as e:
        raise fail("ckpt merge", str(e)) from None
    console.print(f"wrote {path}", markup=False)


@sandbox_app.command("run")
def sandbox_run(
    file: Path = typer.Argument(..., help="the program (.py: Python, .sh: sh)"),
    timeout: float = typer.Option(10.0, "--timeout", help="wall-clock seconds"),
    memory: int = typer.Option(512, "--memory", help="MiB of address space per process"),
    isolation: str = typer.Option("namespaces", "--isolation", help="namespaces, or none (rlimits and uid only)"),
):
    """Run FILE as model-written code is run and print one JSON object: exit_code, stdout, stderr,
    timed_out, killed_reason, wall_s, cpu_s, max_rss_mb. Exits 2 when the sandbox is unavailable."""
    from prl.sandbox import SandboxUnavailable
    from prl.sandbox import run as sandbox_exec

    if not file.is_file():
        raise fail("sandbox run", f"{file}: no such file (give the program to run, e.g. prog.py)")
    try:
        result = sandbox_exec(file, timeout_s=timeout, memory_mb=memory, isolation=isolation)
    except (SandboxUnavailable, ValueError, OSError) as e:
        err.print(f"prl sandbox run: {e}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    print(result.to_json())


if __name__ == "__main__":
    app()

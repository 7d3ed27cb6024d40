"""`prl doctor RECIPE` for a recipe without [cluster]: this machine, checked as `prl run` checks it
before it starts anything (the cluster's checks are `prl.launch.doctor`)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from prl.envs import env_class
from prl.launch import checks, driver
from prl.launch.wandb_log import check_wandb
from prl.recipe.load import RecipeError


LOCAL_MIN_FREE_GB = 1.0  # a local run's directory: checkpoints and published weights of a tiny model fit


def check_local(recipe, console: Console) -> list[str]:
    """A recipe without [cluster]: the checks `prl run` makes before it starts anything (the model
    folder, the inference backend, Mooncake for the KV pool, the task and environment with the
    sandbox, W&B, what is not built yet), plus free disk where the run directory goes, one row each.
    Returns the failures as "check: detail" lines. Ports need no check: a local run picks free ones."""

    def model():
        driver.check_model(recipe, driver.local_folder(recipe))
        return recipe.model.path or f"tiny {recipe.model.arch} (built at start)"

    def backend():
        driver.check_backend(recipe, driver.local_folder(recipe))
        return recipe.inference.backend

    def kv_pool():
        driver.check_kv_pool(recipe)
        return "Mooncake runs here" if recipe.inference.kv_pool.enabled else "not used"

    def task():
        driver.check_task(recipe)  # the environment too, and the sandbox where it runs programs
        sandbox = f", sandbox ({recipe.env.sandbox.isolation}) runs programs" if env_class(recipe.env.kind).needs_sandbox else ""
        return f"{recipe.task.name}, env {recipe.env.kind}{sandbox}"

    def wandb():
        check_wandb(recipe)
        return "W&B importable" if recipe.run.wandb else "not used"

    def built():
        missing = checks.not_built(recipe)
        if missing:
            raise RecipeError("not built yet: " + "; ".join(missing))
        return "every option is built"

    table = Table(title="prl doctor (this machine)", title_justify="left")
    table.add_column("check")
    table.add_column("result")
    failures = []
    for name, fn in (("model", model), ("backend", backend), ("kv pool", kv_pool), ("task and env", task), ("wandb", wandb),
                     ("built", built)):
        try:
            table.add_row(name, f"[green]ok[/] {fn()}")
        except (RecipeError, driver.RunStopped, ValueError) as e:
            table.add_row(name, "[red]FAIL[/] see below")
            failures.append(f"{name}: {e}")
    ok, detail = local_disk(recipe)
    table.add_row("disk", f"[green]ok[/] {detail}" if ok else "[red]FAIL[/] see below")
    if not ok:
        failures.append(f"disk: {detail}")
    console.print(table)
    return failures


def local_disk(recipe) -> tuple[bool, str]:
    """Free space where the run directory goes (its nearest existing parent)."""
    import shutil
    from pathlib import Path

    where = Path(recipe.run.output_dir).absolute()
    while not where.exists():
        where = where.parent
    free_gb = shutil.disk_usage(where).free / 1e9
    ok = free_gb >= LOCAL_MIN_FREE_GB
    return ok, f"{free_gb:.1f} GB free in {where}" + ("" if ok else f"; a run needs at least {LOCAL_MIN_FREE_GB:g} GB: "
                                                                  f"free some, or set run.output_dir elsewhere")

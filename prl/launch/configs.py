"""The run's per-process configs: `prl.recipe.resolve` derives them from a checked recipe, given what the
classes the recipe names say (`Facts`), which this module asks them (the recipe layer imports none)."""

from __future__ import annotations

from pathlib import Path

from prl.backends import registry
from prl.envs import env_class
from prl.recipe import resolve as resolution
from prl.recipe.resolve import Facts, ProcessConfig
from prl.recipe.schema import Recipe


def facts(recipe: Recipe) -> Facts:
    """The backend's publish format and whether the environment class needs sandbox workers."""
    return Facts(publish_format=registry.get(recipe.inference.backend).publish_format,
                 sandbox=env_class(recipe.env.kind).needs_sandbox)


def resolve(recipe: Recipe, run_dir: Path, secret_file: Path | None = None) -> list[ProcessConfig]:
    """One config per process (`prl.recipe.resolve.resolve`) with the recipe's `facts`."""
    return resolution.resolve(recipe, run_dir, secret_file, facts=facts(recipe))

"""The recipe reference comes from the schema: every key described, docs/recipe-reference.md equal to `prl keys`,
and `--dry-run`'s TOML of every key parses back into the same recipe."""

import re
import sys
from pathlib import Path

import pytest

from prl.recipe import Recipe, RecipeError, load_recipe
from prl.recipe.reference import keys_text, recipe_toml, tables

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "recipe-reference.md"
REGENERATE = ('.venv/bin/python -c "from prl.recipe.reference import keys_text; print(keys_text(), end=\'\')" '
              "> docs/recipe-reference.md")


def test_every_key_and_table_is_described():
    missing = [f"{t.name or 'Recipe'}.{key}" for t in tables() for key, info in t.model.model_fields.items()
               if not (info.description or "").strip()]
    assert not missing, f"give these schema fields a docstring in prl/recipe/schema.py: {missing}"
    assert all(t.description for t in tables()[1:])


def test_descriptions_are_safe_markdown():
    """Outside code spans `<word>` is an HTML tag to GitHub (the text vanishes): write it in backticks."""
    bad = [f"{t.name}.{key}" for t in tables() for key, info in t.model.model_fields.items()
           if any(re.search(r"<[A-Za-z/]", part) for part in (info.description or "").split("`")[::2])]
    assert not bad, f"put <...> in backticks in these descriptions: {bad}"


def test_reference_file_is_the_schema():
    assert REFERENCE.read_text() == keys_text(), (
        f"docs/recipe-reference.md differs from the schema; regenerate it: {REGENERATE}")


def test_one_table():
    text = keys_text("trainer.loss")
    keys = re.findall(r"^- \*\*`([\w.]+)`\*\*", text, flags=re.M)
    assert "trainer.loss.correction" in keys and len(keys) == len(Recipe.model_fields["trainer"].annotation
                                                                 .model_fields["loss"].annotation.model_fields)
    assert all(k.startswith("trainer.loss.") for k in keys), keys
    assert "## [trainer.loss]" in text and "## [trainer]" not in text
    assert '"gspo"' in text and 'default `"clip"`' in text
    trainer = keys_text("trainer")  # a table brings the tables under it
    assert "trainer.lr" in trainer and "trainer.parallel.ep" in trainer and "inference." not in trainer


def test_entries_say_type_default_limits():
    text = keys_text()
    assert '- **`run.name`**: `str`, default `"run"`, matching `^[A-Za-z0-9._-]+$`' in text
    assert "- **`trainer.loss.clip_low`**: `float`, default `0.2`, `0 < value < 1`" in text
    assert "- **`cluster.hosts.address`**: `str`, required" in text
    assert "- **`sft.steps`**: `int`, default unset, `value >= 0`" in text
    assert "- **`run.wandb`**: optional table" in text and "## [[cluster.hosts]]" in text
    assert "`list[str]`" in text and "`dict[str, str]`" in text
    assert keys_text("inference.vllm").startswith("- **`inference.vllm`**: `dict[str, any]`")  # a key, by name


def test_unknown_table_names_it_and_the_tables():
    with pytest.raises(KeyError) as e:
        keys_text("trainr.loss")
    msg = str(e.value)
    assert "'trainr.loss'" in msg and "trainer.loss" in msg and "\n" not in msg


def round_trip(recipe: Recipe) -> None:
    text = recipe_toml(recipe)
    data = tomllib.loads(text)
    again = Recipe.model_validate(data)
    assert again == recipe and again.model_dump() == recipe.model_dump(), text


def test_dry_run_toml_of_the_defaults():
    recipe = Recipe.model_validate({})
    text = recipe_toml(recipe)
    round_trip(recipe)
    assert "# path = ...  (unset)" in text and "# share_prompts = ...  (unset)" in text  # None: commented
    assert "# [cluster]  (unset)" in text and "# [run.wandb]  (unset)" in text
    data = tomllib.loads(text)
    assert "path" not in data["model"] and data["trainer"]["loss"]["correction"] == "clip"
    assert data["inference"]["vllm"] == {} and data["task"]["options"] == {}


def test_dry_run_toml_marks_required_and_writes_inline_tables():
    recipe = load_recipe(ROOT / "recipes/reverse-tiny.toml",
                         ['run.wandb={project="rl", tags=["a b", "c\\"d"]}', "cluster.hosts=[{address='10.0.0.1'}]",
                          "cluster.env={NCCL_SOCKET_IFNAME='eth0', 'A.B'='x'}"])
    text = recipe_toml(recipe)
    assert 'project = "rl"  # required' in text and 'address = "10.0.0.1"  # required' in text
    assert "[[cluster.hosts]]  # required" in text
    assert 'env = { NCCL_SOCKET_IFNAME = "eth0", "A.B" = "x" }' in text
    round_trip(recipe)


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_recipes_round_trip(path):
    try:
        recipe = load_recipe(path)
    except RecipeError as e:  # a recipe whose validation reads files absent here cannot be rebuilt here either
        if "not found" in str(e) or "No such file" in str(e):
            pytest.skip(f"{path.name} needs files that are not here: {e}")
        raise
    round_trip(recipe)


def test_imports_without_torch():
    import subprocess

    code = "import sys, prl.recipe.reference; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stdout + out.stderr

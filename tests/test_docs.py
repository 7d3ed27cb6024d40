"""The docs stay short at the front, say no development history, name only keys the schema has, link
only to files that exist, and build as a site (`mkdocs build --strict`, when mkdocs is installed)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from prl.recipe.schema import Recipe

ROOT = Path(__file__).resolve().parent.parent
GENERATED = {"recipe-reference.md"}  # written by `prl keys`, checked against the schema by its own test


def pages(skip_generated: bool = False) -> list[Path]:
    docs = sorted((ROOT / "docs").glob("*.md"))
    if skip_generated:
        docs = [p for p in docs if p.name not in GENERATED]
    return [ROOT / "README.md", *docs]


def prose(text: str) -> str:
    """The text without fenced code blocks (their backticks and brackets are code, not markup)."""
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 200, f"README.md has {lines} lines; move detail into docs/ (at most 200)"


def test_readme_keeps_the_ci_test_command():
    assert "bin/test" in (ROOT / "README.md").read_text()  # .ci/run calls it; the README says so


HISTORY = re.compile(r"\b(session|issue|round)s?\s+#?\d+", re.I)


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_no_development_history(page):
    found = [m.group(0) for m in HISTORY.finditer(page.read_text())]
    assert not found, f"{page.relative_to(ROOT)}: {found}: history belongs in CHANGELOG.md"


# ---- every `section.key` the docs name exists in the schema ----

def _unwrap(annotation) -> list:
    """The types a field may hold: Optional, unions and lists opened up."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [t for a in typing.get_args(annotation) if a is not type(None) for t in _unwrap(a)]
    if origin is list:
        return _unwrap(typing.get_args(annotation)[0])
    return [annotation]


def key_exists(path: list[str], model: type[BaseModel] = Recipe) -> bool:
    """`path` names a field of `model`, walking nested sections; any sub-key of a dict-typed field
    (`inference.vllm.*`, `cluster.env.*`, `task.options.*`) is accepted."""
    field = model.model_fields.get(path[0])
    if field is None:
        return False
    if len(path) == 1:
        return True
    for t in _unwrap(field.annotation):
        if typing.get_origin(t) is dict or t is dict:
            return True
        if isinstance(t, type) and issubclass(t, BaseModel) and key_exists(path[1:], t):
            return True
    return False


SECTIONS = "|".join(sorted(Recipe.model_fields, key=len, reverse=True))
# a dotted key starting with a section name, not preceded by a path or identifier character
DOTTED = re.compile(rf"(?<![\w./:-])(?:{SECTIONS})(?:\.[A-Za-z_][\w-]*)+")
FILE_SUFFIXES = {"json", "jsonl", "safetensors", "toml", "py", "log", "md", "png", "html", "txt", "sh", "index"}


def named_keys(text: str) -> set[str]:
    keys = set()
    for span in re.findall(r"`([^`\n]+)`", prose(text)):
        for m in DOTTED.finditer(span):
            parts = m.group(0).split(".")
            if parts[-1] in FILE_SUFFIXES or any(p.isupper() for p in parts[1:]):
                continue  # a file name (`model.safetensors`) or a placeholder (`plan.KEY`)
            keys.add(m.group(0))
    return keys


def test_key_check_itself():
    assert key_exists(["trainer", "lr"]) and key_exists(["inference", "vllm", "max_model_len"])
    assert key_exists(["env", "sandbox", "workers"]) and key_exists(["cluster", "hosts", "port"])
    assert key_exists(["run", "wandb", "tags"]) and not key_exists(["trainer", "lrr"])
    assert named_keys("use `--set trainer.lr=1e-5`, `model.safetensors`, `plan.KEY`, `prl.model.fp8`") == {"trainer.lr"}


@pytest.mark.parametrize("page", pages(skip_generated=True), ids=lambda p: p.name)
def test_keys_in_the_docs_exist(page):
    unknown = sorted(k for k in named_keys(page.read_text()) if not key_exists(k.split(".")))
    assert not unknown, f"{page.relative_to(ROOT)} names keys the schema does not have: {unknown}"


# ---- links ----

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, mailto:, or an anchor in the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


def test_mkdocs_nav_lists_every_page():
    nav = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r":\s*([\w.-]+\.md)\s*$", nav, flags=re.M))
    on_disk = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert on_disk <= listed, f"pages missing from mkdocs.yml's nav: {sorted(on_disk - listed)}"


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs-material is not installed (the `docs` extra: pip install -e '.[docs]')")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"

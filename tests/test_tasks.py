"""Built-in tasks and user tasks named by `module:function`."""

import subprocess

import pytest

from conftest import prl_cmd
from prl.recipe.schema import TaskCfg
from prl.tasks import make_task
from prl.tasks.builtin import edit_similarity


@pytest.mark.parametrize("name", ["reverse", "sort", "add"])
def test_builtin_tasks_are_deterministic_and_scored(name):
    task = make_task(TaskCfg(name=name), seed=3)
    ex = task.example(5)
    assert ex == task.example(5) and ex != task.example(6)
    assert task.reward(ex["answer"], ex) == 1.0 and 0.0 <= task.reward("zz", ex) < 1.0


def test_edit_similarity():
    assert edit_similarity("abc", {"answer": "abc"}) == 1.0
    assert edit_similarity("abd", {"answer": "abc"}) == pytest.approx(2 / 3)
    assert edit_similarity("", {"answer": "abc"}) == 0.0


def test_custom_task_by_module_function():
    cfg = TaskCfg(name="custom", dataset="prl.tasks.builtin:sort_dataset", reward="prl.tasks.builtin:exact_match")
    task = make_task(cfg, seed=0)
    ex = task.example(0)
    assert ex["prompt"].startswith("sort:") and task.reward(ex["answer"], ex) == 1.0


def test_unimportable_task_fails_before_start(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f"[run]\noutput_dir = '{tmp_path}/runs'\n[task]\nname = 'custom'\n"
                      "dataset = 'no_such_module:data'\nreward = 'prl.tasks.builtin:exact_match'\n")
    p = subprocess.run(prl_cmd("run", recipe, "--no-tui"), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "task.dataset" in p.stdout + p.stderr and "no_such_module" in p.stdout + p.stderr
    assert not (tmp_path / "runs").exists()

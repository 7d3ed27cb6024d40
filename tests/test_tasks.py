"""Built-in tasks and user tasks named by `module:function`."""

import os
import subprocess
import sys

import pytest

from conftest import prl_cmd
from prl.recipe.schema import TaskCfg
from prl.tasks import make_task
from prl.tasks.builtin import edit_similarity


@pytest.mark.parametrize("name", ["reverse", "reverse_long_tail", "sort", "add"])
def test_builtin_tasks_are_deterministic_and_scored(name):
    task = make_task(TaskCfg(name=name), seed=3)
    ex = task.example(5)
    assert ex == task.example(5) and ex != task.example(6)
    assert task.reward(ex["answer"], ex) == 1.0 and 0.0 <= task.reward("zz", ex) < 1.0


def test_long_tail_reversal_has_a_tail_of_ten_times_the_median():
    task = make_task(TaskCfg(name="reverse_long_tail", min_len=3, max_len=60), seed=0)
    lengths = sorted(len(task.example(i)["answer"]) for i in range(2000))
    assert lengths[1000] == 3 and lengths[1980] >= 27 and lengths[-1] <= 60  # p99 about 10x p50


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
    p = subprocess.run(prl_cmd("run", recipe, "--no-tui"), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "task.dataset" in p.stdout + p.stderr and "no_such_module" in p.stdout + p.stderr
    assert not (tmp_path / "runs").exists()


# reasoning-gym tasks (the `envs` extra; the real package, nothing mocked)

def rg_task(name="basic_arithmetic", seed=3, **options):
    return make_task(TaskCfg(name=f"reasoning_gym:{name}", options=options), seed=seed)


def test_reasoning_gym_items_are_a_function_of_index_and_seed():
    task = rg_task(size=10)
    ex = task.example(5)
    assert ex["prompt"] == rg_task(size=10).example(5)["prompt"] and ex["answer"] == task.example(5)["answer"]
    assert ex["prompt"] and ex["prompt"] != task.example(6)["prompt"]
    assert ex["prompt"] != rg_task(seed=4, size=10).example(5)["prompt"]
    # past the dataset's size the next chunk is another seed, not the first chunk shifted by one
    prompts = [task.example(i)["prompt"] for i in range(30)]
    assert len(set(prompts)) == 30


def test_reasoning_gym_items_are_the_same_in_another_process():
    """A resumed run is another process (another hash seed): it must see the same problems."""
    code = ("from prl.recipe.schema import TaskCfg; from prl.tasks import make_task\n"
            "for n in ('basic_arithmetic', 'spell_backward', 'word_sorting'):\n"
            "    t = make_task(TaskCfg(name='reasoning_gym:' + n, options={'size': 8}), seed=11)\n"
            "    print([t.example(i)['prompt'] + t.example(i)['answer'] for i in (0, 9)])\n")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONHASHSEED": h}) for h in ("1", "2")]
    assert outs[0].returncode == 0, outs[0].stderr
    assert outs[0].stdout == outs[1].stdout and outs[0].stdout.count("\n") == 3


@pytest.mark.parametrize("name", ["basic_arithmetic", "spell_backward", "prime_factorization"])
def test_reasoning_gym_reward_is_the_datasets_own_score(name):
    task = rg_task(name, size=20)
    for i in (0, 1, 25):
        ex = task.example(i)
        assert task.reward(ex["answer"], ex) == 1.0
        assert task.reward(f"thinking...\n<answer> {ex['answer']} </answer>", ex) == 1.0
        assert 0.0 <= task.reward("zz no", ex) < 1.0  # prime_factorization's scorer raises on it: 0, no crash
        assert task.reward(f"<answer>{ex['answer']}</answer> <answer>7x</answer>", ex) < 1.0  # the last tag counts


def test_reasoning_gym_composite_mixes_tasks():
    task = rg_task("composite", size=30, datasets=[{"name": "chain_sum", "weight": 1},
                                                   {"name": "spell_backward", "weight": 1, "config": {"min_word_len": 4}}])
    exs = [task.example(i) for i in range(30)]
    assert {ex["item"]["metadata"]["source_dataset"] for ex in exs} == {"chain_sum", "spell_backward"}
    assert all(task.reward(ex["answer"], ex) == 1.0 for ex in exs)


@pytest.mark.parametrize("cfg, says", [
    ({"name": "reasoning_gym:basic_arithmetc"}, "did you mean basic_arithmetic"),
    ({"name": "reasoning_gym:word_ladder"}, "hash seed"),
    ({"name": "reasoning_gym:basic_arithmetic", "options": {"no_such_key": 1}}, "no_such_key"),
    ({"name": "reasoning_gym:basic_arithmetic", "options": {"seed": 1}}, "task.options.seed"),
    ({"name": "reasoning_gym:composite", "options": {"datasets": [{"name": "nope", "weight": 1}]}}, "'nope'"),
])
def test_reasoning_gym_refusals_name_the_key(cfg, says):
    with pytest.raises(ValueError, match="task\\.") as e:
        make_task(TaskCfg(**cfg), seed=0)
    assert says in str(e.value)


def test_reasoning_gym_name_and_options_shape_checked_by_the_schema():
    for bad in ("reasoning_gym:", "reasoning_gym:a-b", "gsm8k"):
        with pytest.raises(ValueError, match="task.name"):
            TaskCfg(name=bad)
    with pytest.raises(ValueError, match="task.options"):
        TaskCfg(name="reverse", options={"size": 3})


def test_unknown_reasoning_gym_task_fails_before_start(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f"[run]\noutput_dir = '{tmp_path}/runs'\n[task]\nname = 'reasoning_gym:no_such_task'\n")
    p = subprocess.run(prl_cmd("run", recipe, "--no-tui"), capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "task.name" in out and "no_such_task" in out and "nothing was started" in out
    assert not (tmp_path / "runs").exists()


def test_characters_the_tiny_tokenizer_does_not_know_are_named():
    """prl's tiny tokenizer knows a small alphabet: a prompt's other characters would silently become <unk>."""
    from prl.model.tiny import char_tokenizer
    from prl.tasks.prompts import unknown_characters

    tok = char_tokenizer()
    assert unknown_characters(tok, ["reverse: abc", [{"role": "user", "content": "ab"}]]) == []
    assert unknown_characters(tok, ["héllo wörld", [{"role": "user", "content": "€5"}]]) == ["é", "ö", "€"]

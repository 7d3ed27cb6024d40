"""Dataset files as a source of examples (`task.data`, eval sets' `data`, `sft.data`), the one prompt
rendering with chat templates, and the refusals of bad files and keys before anything starts."""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

import pytest

from prl.envs import SkipExample, make_env
from prl.envs.sft_data import SftFile
from prl.launch.driver import RecipeError, preflight
from prl.model.tiny import EOS_ID, char_tokenizer
from prl.recipe.load import load_recipe
from prl.recipe.schema import EnvCfg, SamplingCfg, SftCfg, TaskCfg
from prl.tasks import make_task
from prl.tasks.data import DataSource, ListRows
from prl.tasks.files import row_count
from prl.trainer.trainer import sft_sample

sys.path.insert(0, str(Path(__file__).parent))
from test_envs import chat_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"prompt": f"add:{i}+{i + 1}=", "answer": i + i + 1, "level": i % 3} for i in range(23)]


def write_formats(d: Path) -> dict[str, Path]:
    """The same rows as jsonl (a blank line and CRLF inside), json, csv, parquet and a datasets folder."""
    import datasets

    out = {"jsonl": d / "r.jsonl", "json": d / "r.json", "csv": d / "r.csv", "parquet": d / "r.parquet",
           "folder": d / "folder"}
    lines = [json.dumps(r) for r in ROWS]
    out["jsonl"].write_bytes(("\r\n".join(lines[:5]) + "\n\n" + "\n".join(lines[5:])).encode())
    out["json"].write_text(json.dumps(ROWS))
    with open(out["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        w.writeheader()
        w.writerows(ROWS)
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(out["parquet"]))
    ds.save_to_disk(str(out["folder"]))
    return out


def test_every_format_reads_to_the_same_examples(tmp_path):
    files = write_formats(tmp_path)
    seen = {}
    for kind, path in files.items():
        cfg = TaskCfg(data=str(path), reward="math")
        task = make_task(cfg, seed=5)
        assert row_count(cfg) == len(ROWS)
        examples = [task.example(i) for i in range(2 * len(ROWS))]
        # csv holds text only: the other columns pass through as the file holds them
        seen[kind] = [(e["prompt"], e["answer"], str(e["level"])) for e in examples]
    assert all(v == seen["jsonl"] for v in seen.values()), {k: v[:2] for k, v in seen.items()}
    assert sorted(seen["jsonl"][:len(ROWS)]) == sorted((r["prompt"], str(r["answer"]), str(r["level"])) for r in ROWS)


def test_each_epoch_is_a_new_shuffle_reproducible_from_the_seed():
    rows = ListRows([{"i": i} for i in range(50)])
    a, b, other = DataSource(rows), DataSource(rows), DataSource(rows)
    order = lambda src, seed, epoch: [src.row_of(epoch * 50 + k, seed) for k in range(50)]  # noqa: E731
    first, second = order(a, 0, 0), order(a, 0, 1)
    assert sorted(first) == sorted(second) == list(range(50))  # each epoch draws every row once
    assert first != second and first != list(range(50))
    assert order(b, 0, 1) == second and order(b, 0, 0) == first  # the same seed, another process, any order asked
    assert order(other, 1, 0) != first
    ranged = DataSource(rows, 10, 20, shuffle=False)
    assert [ranged.row_of(k, 0) for k in range(12)] == [*range(10, 20), 10, 11]


def test_rows_range_and_file_order_for_eval_sets(tmp_path):
    files = write_formats(tmp_path)
    cfg = TaskCfg(data=str(files["jsonl"]), reward="exact", rows=[3, 9], shuffle=False)
    task = make_task(cfg, seed=0)
    assert row_count(cfg) == 6 and [task.example(i)["prompt"] for i in range(7)] == [ROWS[i]["prompt"] for i in (*range(3, 9), 3)]


def test_chat_template_prompt_is_the_tokenizers_own_rendering(tmp_path):
    from prl.model.build import load_tokenizer

    chat_tokenizer().save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    task = make_task(TaskCfg(data=str(write_formats(tmp_path)["jsonl"]), reward="math", system_prompt="be brief"), 0)
    prompt = task.example(0)["prompt"]
    want = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}],
                                   add_generation_prompt=True)["input_ids"]
    assert task.prompt_ids(tok, prompt) == want
    env = make_env(EnvCfg(), TaskCfg(data=str(tmp_path / "r.jsonl"), reward="math", system_prompt="be brief"), 0,
                   tok, SamplingCfg(), 1, False)
    assert env.demonstration(0).prompt_ids == want  # the warm start renders as sampling does
    raw = make_task(TaskCfg(data=str(tmp_path / "r.jsonl"), reward="math", chat_template=False), 0)
    assert raw.prompt_ids(tok, prompt) == tok(prompt).input_ids
    tiny = char_tokenizer()  # no template: "auto" keeps the raw format
    assert task.prompt_ids(tiny, prompt) == tiny(prompt).input_ids


def test_prompt_past_max_prompt_tokens_is_skipped(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "a" * 40, "answer": "1"}) + "\n")
    env = make_env(EnvCfg(), TaskCfg(data=str(path), reward="exact", max_prompt_tokens=39), 0, char_tokenizer(),
                   SamplingCfg(), 2, False)
    with pytest.raises(SkipExample, match="40 tokens"):
        env.prompt_ids(env.example(0))


def sft_rows(path: Path) -> None:
    rows = [{"prompt": "add:1+2=", "completion": "1+2=3"},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                          {"role": "user", "content": "and"}, {"role": "assistant", "content": "ok"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_sft_file_loss_is_on_the_completion_only(tmp_path):
    sft_rows(tmp_path / "sft.jsonl")
    sft = SftCfg(data=str(tmp_path / "sft.jsonl"), steps=1)
    tiny = char_tokenizer()
    demos = SftFile(sft, TaskCfg(), tiny, seed=0)
    demos.source.shuffle = False
    d = demos.demonstration(0)
    assert tiny.decode(d.prompt_ids) == "add:1+2=" and d.completion_ids == tiny("1+2=3").input_ids + [EOS_ID]
    sample = sft_sample(d)
    assert sample.prompt_ids == d.prompt_ids and sum(sample.mask) == len(d.completion_ids)
    # a conversation through a chat template: every assistant turn is trained, the user's turns are context
    tok = chat_tokenizer()
    c = SftFile(sft, TaskCfg(), tok, seed=0)
    c.source.shuffle = False
    d = c.demonstration(1)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "and"}, {"role": "assistant", "content": "ok"}]
    whole = tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False).input_ids
    assert d.prompt_ids + d.completion_ids == whole
    trained = "".join(tok.decode([t]) for t, m in zip(d.completion_ids, d.mask) if m)
    assert trained == "yo<|im_end|>\nok<|im_end|>\n", trained
    assert tok.decode(d.prompt_ids).endswith("<|im_start|>assistant\n")


def recipe_with(tmp_path, *sets: str):
    return load_recipe(ROOT / "recipes/math-tiny.toml", [f"run.output_dir={tmp_path}", *sets])


BAD = {
    "missing file": (['task.data="{d}/nope.jsonl"'], "no such file"),
    "hub name": (['task.data="openai/gsm8k"'], "downloads nothing"),
    "row without the prompt key": (['task.data="{d}/noprompt.jsonl"'], "has no 'prompt' column"),
    "a checker without answers": (['task.data="{d}/noanswer.jsonl"'], "has no 'answer', which the checker"),
    "a prompt that is a number": (['task.data="{d}/numprompt.jsonl"'], "the prompt (int) is neither a string"),
    "every prompt too long": (["task.max_prompt_tokens=10"], "all longer than task.max_prompt_tokens = 10"),
    "parquet that does not parse": (['task.data="{d}/bad.parquet"'], "cannot be read as parquet"),
    "empty file": (['task.data="{d}/empty.jsonl"'], "holds no rows"),
    "not JSON": (['task.data="{d}/notjson.jsonl"'], "row 0 is not JSON"),
    "a split folder": (['task.data="{d}/splits"'], "give one split's folder"),
    "sft file without keys": (['sft.data="{d}/noprompt.jsonl"'], "has neither 'prompt' and 'completion'"),
    "template the tokenizer lacks": (["task.chat_template=true"], "has no chat template"),
}


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "noprompt.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    (d / "noanswer.jsonl").write_text('{"prompt": "1+1="}\n')
    (d / "numprompt.jsonl").write_text('{"prompt": 5, "answer": "2"}\n')
    (d / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    (d / "empty.jsonl").write_text("\n")
    (d / "notjson.jsonl").write_text("{prompt: 1}\n")
    (d / "splits" / "train").mkdir(parents=True)
    (d / "splits" / "dataset_dict.json").write_text("{}")
    return d


@pytest.mark.parametrize("case", list(BAD))
def test_bad_files_and_keys_are_refused_in_one_line(case, bad_files, tmp_path):
    sets, words = BAD[case]
    recipe = recipe_with(tmp_path, *(s.format(d=bad_files) for s in sets))
    with pytest.raises(RecipeError) as e:
        preflight(recipe)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_schema_refusals_name_the_key(tmp_path):
    for sets, words in [(['task.name="add"'], "drop task.name = 'add'"),
                        (['task.reward="regex"'], "a checker (exact, math, choice)"),
                        (["task.rows=[5, 2]"], "rows = [5, 2]"),
                        (['eval.test.data="examples/data/word-problems/train.jsonl"'], "the training file"),
                        (['eval.test.data="examples/data/word-problems/train.jsonl"', "eval.test.rows=[3900, 4000]",
                          "task.rows=[0, 3950]"], "rows training draws")]:
        with pytest.raises(Exception) as e:
            recipe_with(tmp_path, *sets)
        assert words in str(e.value), (sets, str(e.value))
    with pytest.raises(ValueError, match="sft.data needs sft.steps"):
        SftCfg(data="x.jsonl")
    with pytest.raises(ValueError, match="task.rows is for a dataset file"):
        TaskCfg(rows=[0, 10])


def pair_reward(completion: str, example: dict):
    """A user's reward that names the answer it read (the first word)."""
    word = completion.split()[0] if completion.split() else None
    return float(word == example["answer"]), word


def test_checker_answers_are_what_maj_at_k_votes_on(tmp_path):
    from prl.envs import Trajectory
    from prl.evaluation.runner import figures

    path = write_formats(tmp_path)["jsonl"]
    task = make_task(TaskCfg(data=str(path), reward="math"), 0)
    gold = {"answer": "0.5"}
    assert task.score("so it is 1/2", gold) == (1.0, "1/2") and task.score("\\boxed{0.5}", gold) == (1.0, "1/2")
    assert task.score("no idea", gold) == (0.0, "")  # no answer: a vote for none
    user = make_task(TaskCfg(data=str(path), reward="test_data:pair_reward"), 0)
    assert user.score("7 apples", {"answer": "7"}) == (1.0, "7") and user.score("", {"answer": "7"}) == (0.0, "")
    # three samples: two write 1/2 differently (one vote, correct), one writes 3: maj@3 is right
    texts = ["\\boxed{1/2}", "0.5", "3"]
    group = [Trajectory([1], [2], [0.0], [0], *task.score(t, gold)[:1], answer=task.score(t, gold)[1]) for t in texts]
    out = figures([group], [3], 1.0, 0)
    assert out["maj@3"] == 1.0 and out["pass@3"] == 1.0
    wrong = [Trajectory([1], [2], [0.0], [0], *task.score(t, gold)[:1], answer=task.score(t, gold)[1])
             for t in ["3", "3.0", "1/2"]]
    assert figures([wrong], [3], 1.0, 0)["maj@3"] == 0.0  # "3" and "3.0" are one vote for 3


def test_a_run_reads_back_its_own_recipe_and_holds_paths_absolute(tmp_path, monkeypatch):
    """A written recipe (recipe.json holds every key) validates again, as --resume and prl eval read it; a data path
    given relative to the folder prl runs in is held absolute."""
    from prl.recipe.load import validate

    monkeypatch.chdir(ROOT / "examples/custom_data")
    recipe = load_recipe("recipe.toml")
    assert recipe.task.data == str(ROOT / "examples/custom_data/problems.jsonl")
    assert recipe.eval["heldout"].data == recipe.task.data
    again = validate(json.loads(recipe.model_dump_json()), "recipe.json")
    assert again.task == recipe.task and again.eval == recipe.eval


def test_the_training_file_by_another_path_is_still_the_training_file(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(Exception, match="the training file"):
        recipe_with(tmp_path, 'eval.test.data="examples/data/../data/word-problems/train.jsonl"')


def test_a_bad_row_deep_in_the_file_is_skipped_not_fatal(tmp_path):
    """The launch checks the first rows; a bad one met later is a SkipExample naming the file and the row, which the
    orchestrator, an eval set and the warm start pass over."""
    from prl.trainer.trainer import warm_start_demos

    rows = [{"prompt": f"add:{i}=", "answer": str(i)} for i in range(12)]
    rows[9] = {"prompt": ["not", "messages"], "answer": "9"}
    rows[10] = {"prompt": "add:10=", "answer": [1, 0]}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "[11]\n")
    env = make_env(EnvCfg(), TaskCfg(data=str(path), reward="math", shuffle=False), 0, char_tokenizer(),
                   SamplingCfg(), 1, False)
    assert env.example(8)["answer"] == "8"
    for index, words in ((9, "row 9: the prompt (list) is neither"), (10, "row 10: the answer ('answer', list)"),
                         (12, "row 12 is not a JSON object")):
        with pytest.raises(SkipExample, match=re.escape(words)):
            env.example(index)
    demos, nxt, why = warm_start_demos(env, 8, 2)
    assert nxt == 12 and len(demos) == 2 and len(why) == 2  # rows 8 and 11; 9 and 10 skipped


def test_sft_prompt_with_an_assistant_turn_trains_the_completion_only(tmp_path):
    path = tmp_path / "fewshot.jsonl"
    shot = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2"}]
    path.write_text(json.dumps({"prompt": shot, "completion": "4"}) + "\n")
    tok = chat_tokenizer()
    d = SftFile(SftCfg(data=str(path), steps=1), TaskCfg(system_prompt="sys"), tok, seed=0).demonstration(0)
    assert "".join(tok.decode([t]) for t, m in zip(d.completion_ids, d.mask) if m) == "4<|im_end|>\n"
    assert tok.decode(d.prompt_ids).startswith("<|im_start|>system\nsys")
    raw = SftFile(SftCfg(data=str(path), steps=1), TaskCfg(system_prompt="sys", chat_template=False), tok, seed=0)
    r = raw.demonstration(0)  # no template: no system prompt (as RL renders it), the whole prompt's text
    assert tok.decode(r.prompt_ids) == "1+1\n2\n2+2" and r.completion_ids == tok("4").input_ids + [tok.eos_token_id]


@pytest.mark.slow
def test_an_sft_run_from_a_file_alone_exports_its_checkpoint(tmp_path):
    """rl.max_steps = 0 with sft.data: the warm start learns from the file (its loss falls), the held-out set scores
    the step-0 checkpoint, the run ends done, and `prl ckpt export` writes a folder transformers loads."""
    import subprocess

    from conftest import prl_cmd

    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"add:{a}+{b}=", "completion": str(a + b)}) + "\n"
                           for a in range(10) for b in range(10)))
    sets = ["run.output_dir=" + str(tmp_path), "rl.max_steps=0", f'sft.data="{sft}"', "sft.steps=30", "sft.lr=3e-3",
            "eval.heldout.examples=8", "eval.heldout.samples=1"]
    run = subprocess.run(prl_cmd("run", "recipe.toml", "--no-tui", *(x for s in sets for x in ("--set", s))),
                         cwd=ROOT / "examples/custom_data", capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    run_dir = tmp_path / "custom-data"
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sft_steps = [e for e in events if e["kind"] == "trainer_step" and e.get("stage") == "sft"]
    assert len(sft_steps) == 30 and sft_steps[-1]["loss"] < 0.6 * sft_steps[0]["loss"]
    assert not [e for e in events if e["kind"] == "trainer_step" and e.get("stage") == "rl"]
    assert [e["step"] for e in events if e["kind"] == "eval"] == [0]
    assert not [e for e in events if e["kind"] in ("error", "restart")]
    assert json.loads((run_dir / "summary.json").read_text())["state"] == "finished"
    out = tmp_path / "hf"
    export = subprocess.run(prl_cmd("ckpt", "export", run_dir, "--step", "0", "--out", out), capture_output=True,
                            text=True, timeout=300)
    assert export.returncode == 0, export.stderr
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() > 0


def reward_five(completion: str, example: dict):
    return 5.0


def reward_text(completion: str, example: dict):
    return "1" if completion else "0"


@pytest.mark.parametrize("fn,words", [("reward_five", "the reward is 5.0, outside [0, 1]"),
                                      ("reward_text", "the reward is a str ('0')")])
def test_a_reward_outside_0_1_or_not_a_number_is_refused_before_start(fn, words, tmp_path):
    recipe = recipe_with(tmp_path, f'task.reward="test_data:{fn}"')
    with pytest.raises(RecipeError) as e:
        preflight(recipe)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    task = make_task(recipe.task, 0)
    from prl.usercode import UserCodeError

    with pytest.raises(UserCodeError, match=f"task.reward test_data:{fn}: the reward is"):  # at run time: named
        task.reward("x", task.example(0))


def test_a_task_module_that_is_not_on_the_path_says_where_prl_looks(tmp_path):
    with pytest.raises(ValueError, match=r"no module named 'my_rewards' \(run prl from the folder that holds "
                                         r"my_rewards.py, or add that folder to PYTHONPATH\)"):
        make_task(TaskCfg(data=str(write_formats(tmp_path)["jsonl"]), reward="my_rewards:score"), 0)


def test_a_run_passes_over_bad_rows_and_counts_them(tmp_path):
    """A real run on a file whose rows 9 and 10 are bad (past the rows the launch checks): the orchestrator skips
    both, counts them (`skipped_examples`), names each in an `example_skipped` event and trains on the rest."""
    import subprocess

    from conftest import prl_cmd

    rows = [{"prompt": f"add:{i}+1=", "answer": str(i + 1)} for i in range(64)]
    rows[9] = {"prompt": ["not", "messages"], "answer": "10"}
    rows[10] = {"prompt": "add:10+1=", "answer": [1, 1]}
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [f"run.output_dir={tmp_path}", f'task.data="{data}"', "task.rows=[0, 60]", "task.shuffle=false",
            "sft.steps=0", "rl.max_steps=4", f'eval.heldout.data="{data}"', "eval.heldout.rows=[60, 64]"]
    run = subprocess.run(prl_cmd("run", "recipe.toml", "--no-tui", *(x for s in sets for x in ("--set", s))),
                         cwd=ROOT / "examples/custom_data", capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "Traceback" not in run.stdout + run.stderr, run.stdout[-2000:] + run.stderr[-2000:]
    events = [json.loads(line) for line in (tmp_path / "custom-data" / "metrics.jsonl").read_text().splitlines()]
    skipped = [e for e in events if e["kind"] == "example_skipped"]
    assert sorted(e["index"] for e in skipped) == [9, 10], skipped
    assert "row 9: the prompt (list) is neither" in next(e["why"] for e in skipped if e["index"] == 9)
    steps = [e for e in events if e["kind"] == "orch_step"]
    assert len(steps) == 4 and steps[-1]["skipped_examples"] == 2, steps
    assert not [e for e in events if e["kind"] in ("error", "restart")]

"""What the model wrote, kept per step (`prl.orchestrator.samples`) and printed by `prl samples`."""

from __future__ import annotations

import json
import subprocess

from conftest import prl_cmd
from prl.model.tiny import char_tokenizer
from prl.orchestrator.buffer import Group
from prl.orchestrator.samples import SampleWriter, pick, turns
from prl.transport.batch import Sample


def test_pick_keeps_the_best_and_the_worst_and_is_seeded():
    rewards = [0.5, 0.1, 0.9, 0.3, 0.7, 0.2]
    got = pick(rewards, 4, seed=3)
    assert len(got) == 4 and 2 in got and 1 in got and got == sorted(got)
    assert pick(rewards, 4, seed=3) == got and pick(rewards, 1, 0) == [2]
    assert pick(rewards, 10, 0) == list(range(6)) and pick(rewards, 0, 0) == [] and pick([], 3, 0) == []


def test_turns_split_the_models_tokens_from_the_environments():
    tok = char_tokenizer()
    ids = tok("call:get ab").input_ids + tok(" res:c0=").input_ids + tok("42").input_ids
    mask = [1] * 11 + [0] * 8 + [1] * 2
    assert turns(tok, ids, mask) == [{"role": "model", "text": "call:get ab"}, {"role": "env", "text": " res:c0="},
                                     {"role": "model", "text": "42"}]
    assert turns(tok, ids, None) is None and turns(tok, ids, [1] * len(ids)) is None


def write_run(tmp_path):
    tok = char_tokenizer()
    writer = SampleWriter(tmp_path, 2, 0, tok)
    for step in range(3):
        members = [Sample(tok("rev:ab=").input_ids, tok(c).input_ids, [0.0] * 2, [step] * 2, advantage=r - 0.5,
                          reward=r) for c, r in (("ba", 1.0), ("aa", 0.5), ("bb", 0.0))]
        writer.write_step(step, [Group(7 + step, members, infos=[{}, {}, {"turns": 1}])])
    (tmp_path / "metrics.jsonl").write_text("")


def test_prl_samples_prints_a_step_worst_first_and_as_json(tmp_path):
    write_run(tmp_path)
    lines = (tmp_path / "samples" / "steps.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 0, 1, 1, 2, 2]  # best and worst of each step
    out = subprocess.run(prl_cmd("samples", tmp_path, "--worst"), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.index("reward 0.000") < text.index("reward 1.000") and "step 2  example 9" in text
    assert "completion: bb" in text and "step 1" not in text
    got = subprocess.run(prl_cmd("samples", tmp_path, "--step", "1", "--json", "--grep", "ba"), capture_output=True,
                         text=True)
    assert [json.loads(x)["completion"] for x in got.stdout.splitlines()] == ["ba"]
    bad = subprocess.run(prl_cmd("samples", tmp_path, "--step", "9"), capture_output=True, text=True)
    assert bad.returncode == 2 and "steps 0..2" in bad.stderr and "Traceback" not in bad.stderr


def test_an_eval_sets_completions_are_written_and_shown(tmp_path):
    from prl.envs import Trajectory

    tok = char_tokenizer()
    writer = SampleWriter(tmp_path, 2, 0, tok)
    group = [Trajectory(tok("rev:ab=").input_ids, tok(c).input_ids, [0.0] * 2, [5] * 2, r, answer=c)
             for c, r in (("ba", 1.0), ("ab", 0.0))]
    writer.write_eval("heldout", 5, [100, 101], [group, None])  # 101 was skipped
    (tmp_path / "metrics.jsonl").write_text("")
    out = subprocess.run(prl_cmd("samples", tmp_path, "--eval", "heldout"), capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.count("step 5  example 100") == 2 and "answer 'ba'" in out.stdout
    none = subprocess.run(prl_cmd("samples", tmp_path, "--eval", "test"), capture_output=True, text=True)
    assert none.returncode == 2 and "sets: heldout" in none.stderr


def test_the_dashboard_shows_the_latest_sample(tmp_path):
    from prl.tui.state import RunState
    from prl.tui.view import sample_lines

    write_run(tmp_path)
    with open(tmp_path / "samples" / "steps.jsonl", "a") as f:
        f.write('{"step": 3, "cut by a kill')  # a line a killed orchestrator left half-written
    state = RunState().update_from(tmp_path / "metrics.jsonl")
    assert state.latest_sample["step"] == 2
    [line] = sample_lines(state)
    assert "latest sample  step 2  reward" in line.plain and "'rev:ab=' -> " in line.plain

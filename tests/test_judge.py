"""An LLM judge (`[reward.judge]`): the embedded server's /v1/chat/completions, a judge outside the run reached with
its key from the environment, the default score parser, a real run with a judge it serves killed mid-run, and the
refusals."""

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, prl_cmd, run_each, start_server
from prl.envs import Trajectory
from prl.orchestrator.frozen import FrozenServers
from prl.orchestrator.judge import ChatServer, Judge
from prl.orchestrator.rewards import ModelRewards, RewardUnavailable
from prl.recipe.load import load_recipe
from prl.usercode import UserCodeError
from test_reward_model import run_killing
from test_teacher import teacher_folder
from reward_fixture import fit_reward_model

RECIPE = ROOT / "recipes" / "reverse-tiny.toml"

PARSER = '''
def parse(text, example):
    """A score from the judge's answer's length; none for the examples whose answer starts with "a" or "b"."""
    return None if example["answer"][0] in "ab" else len(text) / 10
'''


def test_the_default_parser_takes_the_last_score_and_gives_none_without_one():
    judge = Judge(load_recipe(RECIPE, ['reward.judge.base_url="http://x/v1"']).reward.judge, servers=None)
    cases = {"Score: 7": 7.0, "score 3, then on reflection SCORE = 9.5": 9.5, "Score: -2": -2.0,
             "no number here": None, "Score: none": None, "": None}
    for text, want in cases.items():
        assert judge.score_of(text, {}) == want, text
    judge.parse = lambda text, example: "7"
    with pytest.raises(UserCodeError, match="returned str; it returns a number, or None"):
        judge.score_of("Score: 7", {})
    msg = judge.message({"prompt": "ignored", "answer": "ba"}, [{"role": "user", "content": "rev:ab="}], "ab")
    assert "Task: rev:ab=" in msg and "Reference answer: ba" in msg and "Answer: ab" in msg


def test_chat_completions_are_completions_of_the_rendered_messages(tmp_path):
    """prl's server: /v1/chat/completions of messages equals /v1/completions of their contents joined (the tiny
    tokenizer has no chat template), in OpenAI's chat shape; what it does not do is refused."""
    proc, cfg, client = start_server(tmp_path / "run", load_recipe(RECIPE))
    try:
        body = {"max_tokens": 6, "temperature": 0}
        chat = client.post("/v1/chat/completions", json={**body, "messages": [
            {"role": "system", "content": "rev:ab="}, {"role": "user", "content": "rev:cd="}]})
        plain = client.post("/v1/completions", json={**body, "prompt": "rev:ab=\nrev:cd="})
        assert chat.status_code == 200 and plain.status_code == 200, chat.text
        got, want = chat.json(), plain.json()
        assert got["object"] == "chat.completion" and got["choices"][0]["message"]["role"] == "assistant"
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["text"]
        assert got["usage"] == want["usage"]
        assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 422
        newer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "rev:ab="}],
                                                          "max_tokens": 0, "max_completion_tokens": 3})
        assert newer.status_code == 200 and newer.json()["usage"]["completion_tokens"] <= 3, newer.text
        refused = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                             "stream": True})
        assert refused.status_code == 400 and "stream" in refused.json()["error"]["message"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_judge_outside_the_run_scores_with_its_key_from_the_environment(tmp_path, monkeypatch):
    """A judge at base_url (prl's own server, started on its own): scores parsed and its tokens counted; a parser that
    finds no score drops the group with every such answer counted; a wrong key is a failure, not a score."""
    proc, cfg, client = start_server(tmp_path / "judge", load_recipe(RECIPE))
    monkeypatch.setenv("JUDGE_KEY", cfg.secret())
    recipe = load_recipe(RECIPE, [f'reward.judge={{base_url = "http://{cfg.host}:{cfg.port}/v1", max_tokens = 5, '
                                  f'api_key_env = "JUDGE_KEY", weight = 0.5}}', "reward.task_weight=0"])
    from prl.model.tiny import char_tokenizer
    from prl.orchestrator.judge import judge_servers

    tok = char_tokenizer()
    trajs = [Trajectory([5], tok("ab").input_ids, [0.0] * 2, [0] * 2, 1.0),
             Trajectory([5], tok("ba").input_ids, [0.0] * 2, [0] * 2, 0.0)]

    async def judged(parse, key_env="JUDGE_KEY"):
        judge = recipe.reward.judge.model_copy(update={"api_key_env": key_env})
        servers = FrozenServers("judge", judge_servers(judge, [], ""), retry_s=2, hang_s=30)
        try:
            return await ModelRewards(recipe.reward, tok, judge=Judge(judge, servers, parse)).rewarded(
                {"prompt": "rev:ab=", "answer": "ba"}, trajs)
        finally:
            await servers.close()

    seen = []
    try:
        scored, figures = asyncio.run(judged(lambda text, ex: seen.append(text) or len(text) / 10))
        assert [t.reward for t in scored] == pytest.approx([0.5 * len(t) / 10 for t in seen])
        assert figures["judge_score"] == pytest.approx(sum(len(t) / 10 for t in seen)) and figures["judge_tokens"] > 0
        with pytest.raises(RewardUnavailable) as none:
            asyncio.run(judged(lambda text, ex: None))
        assert none.value.unparsed == 2
        monkeypatch.setenv("WRONG_KEY", "not-the-key")
        with pytest.raises(RewardUnavailable, match="401"):
            asyncio.run(judged(lambda text, ex: 1.0, key_env="WRONG_KEY"))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_a_run_with_a_judge_it_serves_counts_unparsable_answers_and_restarts_a_killed_judge(tmp_path):
    """`prl run` with [reward.judge] served by the run (judge-0) and a parser that finds no score for some examples:
    those groups are dropped and counted, never scored; judge-0 killed mid-run is restarted; the run ends well."""
    (tmp_path / "judging.py").write_text(PARSER)
    folder = teacher_folder(tmp_path / "judge")
    sets = [f"run.output_dir={tmp_path}", "sft.steps=0", "rl.max_steps=5", "eval.heldout.examples=8",
            f'reward.judge={{path = "{folder}", parser = "judging:parse", max_tokens = 4, timeout_s = 30}}']
    out, events = run_killing(tmp_path, sets, "judge-0", env={"PYTHONPATH": str(tmp_path)})
    steps = [e for e in events if e["kind"] == "orch_step"]
    assert len(steps) == 5 and all(e["judge_tokens"] > 0 and e["task_reward"] >= 0 for e in steps)
    assert sum(e["judge_unparsed"] for e in steps) > 0 and sum(e["reward_dropped"] for e in steps) > 0
    for e in steps:  # the reward trained on: the task's plus the judge's parsed score
        assert e["reward"] == pytest.approx(e["task_reward"] + e["judge_score"], abs=1e-6)
    assert [e for e in events if e["kind"] == "reward_dropped" and "no score" in e["why"]]
    assert [e for e in events if e["kind"] == "restart" and e.get("name") == "judge-0"], out[-3000:]
    assert not [e for e in events if e["kind"] == "error" and e.get("name") != "judge-0"]


@pytest.mark.slow
def test_a_run_whose_judge_never_answers_stops_in_one_line_after_dropping_groups(tmp_path):
    """An outside judge nobody listens at: each group is retried for three timeouts, then dropped and counted; 32
    groups in a row without a score stop the run at once (no restart) in one line naming the reason."""
    sets = [f"run.output_dir={tmp_path}", "sft.steps=0", "rl.max_steps=3", "eval.heldout.examples=8",
            'reward.judge={base_url = "http://127.0.0.1:9/v1", timeout_s = 1.0, concurrency = 256}']
    p = subprocess.run(prl_cmd("run", RECIPE, "--no-tui", *(x for s in sets for x in ("--set", s))),
                       capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "32 groups in a row got no score (reward_dropped)" in out, out[-3000:]
    assert "127.0.0.1:9" in out and "Traceback" not in out and "env.on_error" not in out, out[-3000:]  # the URL
    events = [json.loads(line) for line in (tmp_path / "reverse-tiny" / "metrics.jsonl").read_text().splitlines()]
    dropped = [e for e in events if e["kind"] == "reward_dropped"]
    assert len(dropped) == 20 and dropped[-1]["total"] == 20 and "judge's servers failed" in dropped[0]["why"]
    assert not [e for e in events if e["kind"] in ("restart", "orch_step")]


def test_a_judge_prl_cannot_ask_is_refused_before_anything_starts(tmp_path):
    folder = teacher_folder(tmp_path / "judge")
    classifier = fit_reward_model(tmp_path / "classifier", steps=1)
    cases = {f'reward.judge.path="{tmp_path}/nowhere"': "is not a folder",
             'reward.judge={base_url = "http://127.0.0.1:9/v1", api_key_env = "PRL_TEST_UNSET_KEY"}':
                 "'PRL_TEST_UNSET_KEY': that variable is not set",
             f'reward.judge={{path = "{folder}", base_url = "http://x/v1"}}': "one of them",
             f'reward.judge={{path = "{folder}", template = "rate {{prompt}}"}}': "must hold {completion}",
             f'reward.judge={{path = "{folder}", template = "{{completion}} {{oops}}"}}': "it takes {prompt}",
             f'reward.judge={{path = "{folder}", score_regex = "Score: \\\\d+"}}': "needs a group",
             f'reward.judge={{path = "{folder}", parser = "nowhere_module:parse"}}': "no module named 'nowhere_module'",
             f'reward.judge={{path = "{folder}", template = "{{completion:d}}"}}': "cannot be filled",
             'reward.judge.base_url="http://user:key@host/v1"': "reward.judge.base_url",
             f'reward.judge={{path = "{folder}", weight = nan}}': "finite number",
             f'reward.judge.path="{tmp_path}"': "config.json",
             f'reward.judge.path="{classifier}"': "is not a causal language model",
             f'reward.judge.path="{folder}"': None}
    done = run_each([prl_cmd("run", RECIPE, "--dry-run", "--set", override, "--set", f"run.output_dir={tmp_path}")
                     for override in cases])
    for (override, words), p in zip(cases.items(), done):
        out = p.stdout + p.stderr
        if words is None:
            assert p.returncode == 0 and "judge-0" in out, out[-2000:]
        else:
            assert p.returncode == 2 and words in out and "Traceback" not in out, (override, out[-2000:])

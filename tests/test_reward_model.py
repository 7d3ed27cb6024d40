"""A reward model the run serves (`[reward.model]`): the server's scores against transformers' own classifier, the
way scores combine with the task's reward, a real run on the model's score alone with its server killed mid-run,
and the refusals."""

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import ROOT, prl_cmd, run_each, start_server
from prl.envs import Trajectory
from prl.orchestrator.rewards import ModelRewards, RewardUnavailable, combine
from prl.recipe.load import load_recipe
from reward_fixture import fit_reward_model

RECIPE = ROOT / "recipes" / "reverse-tiny.toml"


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory) -> Path:
    return fit_reward_model(tmp_path_factory.mktemp("rm") / "model", steps=100)


def test_scores_combine_with_the_task_reward_by_weight_and_group_normalisation():
    task, scores, judged = [1.0, 0.0, 0.5, 0.25], [2.0, -1.0, 0.5, 4.5], [7.0, 3.0, 10.0, 0.0]
    assert combine(task, 0.5, [(scores, 2.0, "none")]) == pytest.approx([4.5, -2.0, 1.25, 9.125])
    mean = sum(scores) / 4
    std = (sum((s - mean) ** 2 for s in scores) / 4) ** 0.5  # population deviation, as group advantages use
    z = [(s - mean) / std for s in scores]
    assert combine(task, 0.0, [(scores, 3.0, "group")]) == pytest.approx([3.0 * v for v in z])
    assert combine(task, 1.0, [(scores, 3.0, "group"), (judged, 0.1, "none")]) == pytest.approx(
        [r + 3.0 * v + 0.1 * j for r, v, j in zip(task, z, judged)])
    assert combine([0.2, 0.7], 1.0, [([1.5, 1.5], 1.0, "group")]) == [0.2, 0.7]  # equal scores: nothing added


def test_the_servers_scores_are_transformers_classifier_on_each_conversation(tmp_path, reward_folder):
    """Conversations of different lengths scored in one request (padded on the right) equal transformers' forward
    of each alone, and a conversation past max_tokens is cut from its left."""
    from transformers import AutoModelForSequenceClassification

    from prl.model.tiny import char_tokenizer

    recipe = load_recipe(RECIPE, [f'reward.model={{path = "{reward_folder}", max_tokens = 10}}',
                                  "reward.task_weight=0"])
    proc, cfg, client = start_server(tmp_path / "run", recipe, name="reward-model-0")
    items = [("rev:abc=", "cba"), ("rev:hello=", "ol"), ("rev:xy=", "")]
    try:
        r = client.post("/reward", json={"items": [{"prompt": p, "completion": c} for p, c in items]})
        assert r.status_code == 200, r.text
        got = r.json()
        bad = client.post("/reward", json={"items": []})
        assert bad.status_code == 422
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    model, tok = AutoModelForSequenceClassification.from_pretrained(reward_folder).eval(), char_tokenizer()
    with torch.no_grad():
        want = [model(input_ids=torch.tensor([tok(p + c).input_ids[-10:]])).logits[0, 0].item() for p, c in items]
    torch.testing.assert_close(torch.tensor(got["scores"]), torch.tensor(want), atol=1e-5, rtol=0)
    assert got["tokens"] == 10 + 10 + 7


def test_an_encoder_classifier_is_scored_as_transformers_pools_it_and_a_score_that_is_not_finite_is_refused():
    """A BERT-like classifier (no `score` head, pooled at its first token) through the server's app: its padded batch
    equals transformers' forward of each conversation alone; a model giving NaN answers 422, never a score."""
    from fastapi.testclient import TestClient
    from transformers import BertConfig, BertForSequenceClassification

    from prl.inference.reward_model import Scorer, create_app
    from prl.model.tiny import char_tokenizer

    torch.manual_seed(0)
    tok = char_tokenizer()
    model = BertForSequenceClassification(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64, num_labels=1)).eval()
    client = TestClient(create_app(Scorer(model, tok, 64), "key"), headers={"Authorization": "Bearer key"})
    items = [("rev:abc=", "cba"), ("rev:hello=", "ol")]
    r = client.post("/reward", json={"items": [{"prompt": p, "completion": c} for p, c in items]})
    assert r.status_code == 200, r.text
    with torch.no_grad():
        want = [model(input_ids=torch.tensor([tok(p + c).input_ids])).logits[0, 0].item() for p, c in items]
    torch.testing.assert_close(torch.tensor(r.json()["scores"]), torch.tensor(want), atol=1e-5, rtol=0)
    with torch.no_grad():
        model.classifier.weight.fill_(float("nan"))
    bad = client.post("/reward", json={"items": [{"prompt": "rev:ab=", "completion": "ba"}]})
    assert bad.status_code == 422 and "not finite" in bad.text


def test_a_reward_model_that_gives_no_score_drops_the_group_instead_of_scoring_it(tmp_path):
    """A server that never answers: retried for retry_s, then RewardUnavailable (the orchestrator drops the group)."""
    from prl.backends.embedded import EmbeddedBackend
    from prl.orchestrator.frozen import FrozenServers
    from prl.model.tiny import char_tokenizer

    recipe = load_recipe(RECIPE, ['reward.model.path="unused"'])
    trajs = [Trajectory([5, 6], [7], [-1.0], [0], 1.0)] * 2

    async def ask():
        backend = EmbeddedBackend("http://127.0.0.1:9", "secret")  # the discard port: nothing listens
        try:
            servers = FrozenServers("reward-model", [backend], retry_s=1.5)
            return await ModelRewards(recipe.reward, char_tokenizer(), servers).rewarded({"prompt": "rev:ab="}, trajs)
        finally:
            await backend.close()

    t0 = time.monotonic()
    with pytest.raises(RewardUnavailable, match="reward-model's servers failed for 2 s"):
        asyncio.run(ask())
    assert time.monotonic() - t0 >= 1.5


def test_a_run_learns_from_a_reward_model_it_serves_and_restarts_it(tmp_path, reward_folder):
    """`prl run` with [reward.model] and the task's reward at weight 0: every step logs the model's score, the
    task's reward beside it and the model's tokens; reward-model-0 killed mid-run is restarted and no group goes
    unscored (none dropped, none scored 0 in its place); the run ends well."""
    sets = [f"run.output_dir={tmp_path}", "sft.steps=0", "rl.max_steps=6", "eval.heldout.examples=8",
            f'reward.model.path="{reward_folder}"', "reward.task_weight=0", "run.hang_timeout_s=30"]
    out, events = run_killing(tmp_path, sets, "reward-model-0")
    steps = [e for e in events if e["kind"] == "orch_step"]
    assert len(steps) == 6 and all(e["reward_dropped"] == 0 and e["reward_model_tokens"] > 0 for e in steps)
    for e in steps:  # the reward trained on is the model's score alone
        assert e["reward"] == pytest.approx(e["reward_model_score"], abs=1e-6) and 0 <= e["task_reward"] <= 1
    assert [e for e in events if e["kind"] == "restart" and e.get("name") == "reward-model-0"], out[-3000:]
    assert not [e for e in events if e["kind"] == "error" and e.get("name") != "reward-model-0"]


def run_killing(tmp_path: Path, sets: list[str], name: str, env: dict | None = None) -> tuple[str, list[dict]]:
    """`prl run` of reverse-tiny with `sets`, the process `name` SIGKILLed once step 1 is logged; the run must end
    well: (its output, its events)."""
    proc = subprocess.Popen(prl_cmd("run", RECIPE, "--no-tui", *(x for s in sets for x in ("--set", s))),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})
    metrics = tmp_path / "reverse-tiny" / "metrics.jsonl"
    try:
        os.kill(wait_for(metrics, lambda e: e["kind"] == "orch_step" and e["step"] >= 1, name, proc), signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    return out, [json.loads(line) for line in metrics.read_text().splitlines()]


def wait_for(metrics: Path, ready, name: str, run: subprocess.Popen) -> int:
    """Once an event meets `ready`, the pid of the process `name` (from its `process` event); fails at once when the
    run ends first."""
    while run.poll() is None:
        events = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        pids = [e["pid"] for e in events if e["kind"] == "process" and e.get("name") == name
                and e.get("state") == "running"]
        if pids and any(ready(e) for e in events):
            return pids[-1]
        time.sleep(0.5)
    raise AssertionError(f"the run ended before {name} could be killed: {run.stdout.read()[-3000:]}")


def test_a_reward_model_prl_cannot_serve_is_refused_before_anything_starts(tmp_path, reward_folder):
    from prl.model.build import build_model
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    causal = write_model_dir(ModelCfg(num_layers=1), tmp_path / "causal")
    build_model(causal).save_pretrained(causal)
    two = tmp_path / "two-labels"
    two.mkdir()
    for f in reward_folder.iterdir():
        (two / f.name).symlink_to(f)
    (two / "config.json").unlink()
    config = json.loads((reward_folder / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**config, "id2label": {"0": "bad", "1": "good"}}))
    cases = {f'reward.model.path="{tmp_path}/nowhere"': "is not a folder",
             f'reward.model.path="{causal}"': "has no classification head",
             f'reward.model.path="{two}"': "a classifier of 2 labels",
             "reward.task_weight=0.5": "reward.task_weight without [reward.model] or [reward.judge]",
             f'reward={{task_weight = 0, model = {{path = "{reward_folder}", weight = 0}}}}':
                 "every model's weight are 0"}
    done = run_each([prl_cmd("run", RECIPE, "--dry-run", "--set", override) for override in cases])
    for (override, words), p in zip(cases.items(), done):
        out = p.stdout + p.stderr
        assert p.returncode == 2 and words in out and "Traceback" not in out, (override, out[-2000:])

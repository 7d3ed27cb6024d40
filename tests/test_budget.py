"""The in-flight budget follows a real embedded server's KV usage (issue 22): a server whose small KV
capacity fills holds requests back and the budget halves; once it empties the budget grows back."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from prl.model.tiny import write_model_dir
from prl.orchestrator.budget import InflightBudget
from prl.recipe.resolve import resolve, write_configs, write_secret
from prl.recipe.schema import Recipe

CAPACITY = 4 * (4 + 200)  # token slots: four requests of a 4-token prompt and 200 new tokens


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    recipe = Recipe.model_validate({"inference": {"kv_capacity_tokens": CAPACITY}})
    write_model_dir(recipe.model, run_dir / "model")
    configs = resolve(recipe, run_dir, write_secret(run_dir))
    cfg = configs[0]
    path = write_configs(configs, run_dir)[cfg.name]
    log = open(run_dir / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "prl.inference", "--config", str(path)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = httpx.Client(base_url=f"http://{cfg.host}:{cfg.port}", headers={"Authorization": f"Bearer {cfg.secret()}"},
                          timeout=120)
    while True:  # until it answers (a dead server fails at once)
        try:
            if client.get("/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert proc.poll() is None, (run_dir / "server.log").read_text()
        time.sleep(0.2)
    yield client
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(30)


def metrics(client) -> dict:
    return client.get("/metrics").json()


def wait_for(client, cond, what: str) -> dict:
    deadline = time.monotonic() + 120  # only how long the test waits before failing
    while True:
        m = metrics(client)
        if cond(m):
            return m
        assert time.monotonic() < deadline, f"never saw {what}: {m}"
        time.sleep(0.05)


def test_budget_backs_off_when_the_kv_fills_and_grows_when_it_empties(small_server):
    client = small_server
    assert metrics(client)["kv_usage"] == 0.0
    answers = []

    def one():
        r = client.post("/generate", json={"prompt_ids": [5, 6, 7, 8], "max_tokens": 200, "temperature": 1.0,
                                           "stop_token_ids": []})
        answers.append(r.status_code)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    # four fit in the capacity, the other four wait (all eight admitted: this never holds, the test fails)
    full = wait_for(client, lambda m: m["running"] == 4 and m["waiting"] == 4, "four running, four held back")
    assert full["kv_usage"] == 1.0
    budget = InflightBudget(cap=64, group_size=8, servers=1, target=0.9)
    assert budget.total() == 64
    budget.observe(0, full["kv_usage"], inflight=64)  # as the orchestrator does on each /metrics
    assert budget.total() == 32, "above the target: halved"
    budget.observe(0, full["kv_usage"], inflight=32)
    assert budget.total() == 16
    for t in threads:
        t.join(120)
    assert answers == [200] * 8, "every request was served, the ones held back later"
    empty = wait_for(client, lambda m: m["running"] == 0 and m["waiting"] == 0, "the server empty")
    assert empty["kv_usage"] == 0.0
    grown = []
    for _ in range(8):
        budget.observe(0, empty["kv_usage"], inflight=budget.total())  # the budget is what holds back
        grown.append(budget.total())
    assert grown == [24, 32, 40, 48, 56, 64, 64, 64], "a group's worth per reading, up to the cap"
    budget.observe(0, 0.0, inflight=0)
    assert budget.total() == 64, "nothing asked for: no growth needed, none lost"


def test_unbounded_servers_keep_the_cap_shared():
    budget = InflightBudget(cap=64, group_size=8, servers=2, target=0.9)
    budget.observe(0, None, inflight=64)
    budget.observe(1, 0.95, inflight=64)
    assert budget.limits == [32, 16] and budget.total() == 48 and budget.total([True, False]) == 32
    assert InflightBudget(cap=64, group_size=8, servers=1, target=0).total() == 64

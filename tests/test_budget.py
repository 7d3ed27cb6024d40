"""The in-flight budget follows a real embedded server's KV usage (issue 22): a server whose small KV
capacity fills holds requests back and the budget halves; once it empties the budget grows back."""

import os
import signal
import threading
import time

import pytest

from conftest import start_server
from prl.orchestrator.budget import InflightBudget
from prl.recipe.schema import Recipe

CAPACITY = 4 * (4 + 200)  # token slots: four requests of a 4-token prompt and 200 new tokens


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    recipe = Recipe.model_validate({"inference": {"kv_capacity_tokens": CAPACITY}})
    proc, _, client = start_server(tmp_path_factory.mktemp("run"), recipe, timeout=120)
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


def test_the_data_cursor_skips_what_was_trained_out_of_order():
    """Groups finish out of order: the cursor's position is the lowest prompt not consumed, `ahead` the
    ones consumed past it; a restart from (position, ahead) hands out exactly the prompts not consumed."""
    from prl.orchestrator.buffer import DataCursor

    c = DataCursor()
    c.consume([1, 3, 4])
    assert c.state() == (0, [1, 3, 4])
    c.consume([0])
    assert c.state() == (2, [3, 4])
    again = DataCursor(*c.state())
    handed, i = [], again.position
    for _ in range(3):
        i = again.next_free(i)
        handed.append(i)
        i += 1
    assert handed == [2, 5, 6]
    c.consume([2, 5])
    assert c.state() == (6, [])

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


@pytest.fixture(scope="module")
def second_server(tmp_path_factory):
    proc, _, client = start_server(tmp_path_factory.mktemp("run2"), Recipe(), timeout=120)
    yield client
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(30)


def test_a_conversation_stays_where_its_kv_is_unless_that_server_is_full_or_down(small_server, second_server, tmp_path):
    """Issue 22, item 4: each turn of a conversation goes to the server that ran its last turn (its KV
    is there: the history is a prefix-cache hit), unless that server has no room (its in-flight limit
    reached) or is down; a conversation moved to another server stays there."""
    import asyncio

    from prl.backends.registry import make_backend
    from prl.inference.protocol import GenerateRequest
    from prl.metrics import EventLog
    from prl.orchestrator.orchestrator import GroupSampler, Rollouts
    from prl.orchestrator.servers import ServerPool

    clients = [second_server, small_server]  # the conversation moves to the small one: its turns fit there
    conversation = object()  # what names it (multi-turn: the episode)

    async def go():
        backends = [make_backend("embedded", str(c.base_url), c.headers["Authorization"].removeprefix("Bearer "))
                    for c in clients]
        changed = asyncio.Condition()
        pool = ServerPool(backends, EventLog(tmp_path / "m.jsonl", "test"), changed, hang_timeout_s=60)
        budget = InflightBudget(cap=16, group_size=1, servers=2, target=0.9)  # 8 sequences each
        pool.room = lambda server, n: server.active + n <= budget.limits[server.index]
        await pool.start(60)
        sampler = GroupSampler(pool, 0, Rollouts(changed, 1))  # group 0: its own server is server 0
        history, where = [30, 31, 32, 33], []  # a prompt no other test sent these servers

        async def turn():
            hits = [metrics(c)["prefix_hit_tokens"] for c in clients]
            resp = await sampler.generate(GenerateRequest(prompt_ids=history, max_tokens=6, temperature=1.0,
                                                          stop_token_ids=[]), conversation=conversation)
            history.extend(resp.completions[0].token_ids + [9, 10])  # the environment's reply
            now = [metrics(c)["prefix_hit_tokens"] for c in clients]
            where.append(next(i for i in range(2) if sampler.homes[id(conversation)].server is pool.servers[i]))
            return [b - a for a, b in zip(hits, now)]

        await turn()
        filler = asyncio.create_task(pool.call(2, lambda b, release: b.generate(GenerateRequest(  # group 2: server 0
            prompt_ids=[11, 12], max_tokens=400, temperature=1.0, stop_token_ids=[], n=8)), n=8))
        while pool.servers[0].active < 8:  # the filler's 8 sequences are out on server 0
            assert not filler.done(), filler.exception()
            await asyncio.sleep(0.01)
        moved = await turn()  # server 0 has no room: the turn moves, computing its history on server 1
        filler.cancel()
        await asyncio.gather(filler, return_exceptions=True)
        assert pool.servers[0].active == 0
        stayed = await turn()  # server 0 has room again; the conversation's KV is on server 1
        await pool.mark_down(pool.servers[1], "taken out by the test")
        await turn()
        for b in backends:
            await b.close()
        return where, moved, stayed

    where, moved, stayed = asyncio.run(go())
    assert where == [0, 1, 1, 0]
    assert moved[1] == 0, "its first turn on server 1 reused nothing there"
    assert stayed[1] >= 12 + 5, "the turn that stayed reused its history's KV on server 1 (all but the last token)"


def idle(backend) -> list:
    """The kept-alive connections of the backend's line client (`prl.transport.line_stream`), by their writers."""
    return [writer for kept in backend.lines.idle.values() for _, _, writer in kept]


def test_a_group_frees_each_members_place_as_it_finishes(second_server, tmp_path):
    """Issue 22, item 6: a group's request streams each member as it finishes (embedded engine), and the
    orchestrator's count of sequences in flight drops with it, and so does the server's own count (its
    in-flight limit), so the budget lets new work in while the group waits on its slowest member; the
    group still gets all n members, whole, at the end."""
    import asyncio

    from prl.backends.registry import make_backend
    from prl.inference.protocol import GenerateRequest
    from prl.metrics import EventLog
    from prl.orchestrator.orchestrator import GroupSampler, Rollouts
    from prl.orchestrator.servers import ServerPool

    client = second_server
    req = GenerateRequest(prompt_ids=[30, 32, 34], max_tokens=200, temperature=1.0, seed=3, stop_token_ids=[5, 6], n=4)

    async def go():
        backend = make_backend("embedded", str(client.base_url), client.headers["Authorization"].removeprefix("Bearer "))
        order = []
        alone = await backend.generate(req, on_member=order.append)
        kept = idle(backend)
        changed = asyncio.Condition()
        pool = ServerPool([backend], EventLog(tmp_path / "m.jsonl", "test"), changed, hang_timeout_s=60)
        await pool.start(60)
        rollouts = Rollouts(changed, 4)
        rollouts.pending = 1  # the group, started, before its first request
        trace = []

        async def watch():
            async with changed:
                while True:
                    await changed.wait()
                    trace.append((rollouts.active, pool.servers[0].active))

        watcher = asyncio.create_task(watch())
        resp = await GroupSampler(pool, 0, rollouts).generate(req)
        await asyncio.sleep(0.1)  # the last notifications reach the watcher
        watcher.cancel()
        reused = kept == idle(backend)
        await backend.close()
        return order, alone, resp, trace, (rollouts.active, pool.servers[0].active), (kept, reused)

    order, alone, resp, trace, left, (kept, reused) = asyncio.run(go())
    # a stream read to its end leaves its connection to the next request (a group does not open one)
    assert len(kept) == 1 and reused, kept
    lengths = [len(c.token_ids) for c in alone.completions]
    assert sorted(order) == [0, 1, 2, 3] and len(set(lengths)) > 1, lengths
    assert [lengths[i] for i in order] == sorted(lengths), "members were named in the order they finished"
    assert [c.token_ids for c in resp.completions] == [c.token_ids for c in alone.completions], "same seeds, same members"
    # the run's count and the server's (what its in-flight limit is checked against) drop together
    assert any(0 < a < 4 for a, _ in trace), f"the count in flight dropped member by member: {trace}"
    assert all(a == b for a, b in trace), f"the server's count followed the run's: {trace}"
    assert trace == sorted(trace, reverse=True) and left == (0, 0)


def test_an_eval_sets_requests_leave_training_its_whole_budget(second_server, tmp_path):
    """An eval example's sequences count beside the rollouts (its set's `ShareGate` bounds them, not the
    rollout budget): with a budget of one group and an eval example of as many samples out on a real server,
    training may still start its group, on that server."""
    import asyncio
    import types

    from prl.backends.registry import make_backend
    from prl.inference.protocol import GenerateRequest
    from prl.metrics import EventLog
    from prl.orchestrator.orchestrator import Orchestrator, Rollouts
    from prl.orchestrator.servers import ServerPool

    client = second_server
    req = GenerateRequest(prompt_ids=[30, 32, 34], max_tokens=120, temperature=1.0, seed=5, n=4)

    async def go():
        orch = object.__new__(Orchestrator)  # the parts its budget check and eval sampler read
        backend = make_backend("embedded", str(client.base_url), client.headers["Authorization"].removeprefix("Bearer "))
        orch.changed = asyncio.Condition()
        orch.pool = ServerPool([backend], EventLog(tmp_path / "m.jsonl", "test"), orch.changed, hang_timeout_s=60)
        await orch.pool.start(60)
        orch.rollouts, orch.eval_requests = Rollouts(orch.changed, 4), Rollouts(orch.changed, 4)
        orch.rl = types.SimpleNamespace(max_async_level=1, max_steps=10, overprovision=0.0, group_size=4)
        orch.served, orch.committed, orch.groups_per_batch = 0, 0, 4
        orch.budget = InflightBudget(cap=4, group_size=4, servers=1, target=0.9)
        seen = []

        async def watch():
            async with orch.changed:
                while True:
                    await orch.changed.wait()
                    seen.append((orch.eval_requests.active, orch.rollouts.count(),
                                 orch._budget_open() and orch._room(orch.pool.servers[0], 4)))

        watcher = asyncio.create_task(watch())
        resp = await orch.eval_sampler(0).generate(req)
        watcher.cancel()
        await backend.close()
        return resp, seen

    resp, seen = asyncio.run(go())
    assert len(resp.completions) == 4
    assert [out for out, _, _ in seen] == [3, 2, 1, 0], f"read as each sample ended: {seen}"
    assert all(rollouts == 0 and open_ for _, rollouts, open_ in seen), f"training's budget stayed whole: {seen}"

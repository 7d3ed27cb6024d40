"""The inference client's requests against a real embedded server (a subprocess on loopback): what is
sent again after a transport error and what is not, and a generation's deadline (past it the
request is cancelled and the server stops generating for it)."""

import asyncio
import os
import signal
import time

import httpx
import pytest

from conftest import start_server
from prl.backends.base import BackendError, Pace
from prl.backends.embedded import EmbeddedBackend
from prl.inference.protocol import GenerateRequest
from prl.recipe.schema import Recipe

LONG = 1500  # tokens per completion of the long generation (the model's context is set above it)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    recipe = Recipe.model_validate({"model": {"max_position_embeddings": LONG + 64}})
    proc, cfg, probe = start_server(tmp_path_factory.mktemp("run"), recipe)
    url, secret = f"http://{cfg.host}:{cfg.port}", cfg.secret()
    yield proc, url, secret, probe
    os.killpg(proc.pid, signal.SIGCONT)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(10)


def counting(backend: EmbeddedBackend, path: str) -> list:
    """Every time the client sends a request to `path` (each attempt), appended to the returned list."""
    sent = []

    async def hook(request: httpx.Request):
        if request.url.path == path:
            sent.append(request.url.path)

    backend.http.event_hooks["request"] = [hook]
    return sent


def test_a_generation_past_its_deadline_runs_once_and_is_cancelled_on_the_server(server):
    """A generation still running at its deadline is given up once: not sent again (it may still run,
    a retry would run it twice), and its connection is closed, so the server stops generating it."""
    _, url, secret, probe = server

    async def main():
        backend = EmbeddedBackend(url, secret)
        sent = counting(backend, "/generate")
        try:
            await backend.generate(GenerateRequest(prompt_ids=[5, 6, 7], max_tokens=4, stop_token_ids=[]))
            assert len(sent) == 1 and len(backend.pace.recent) == 1, "a generation's pace is measured"
            backend.pace = Pace(floor_s=1.0, slack=0.0)  # a deadline of 1 s, far short of the long generation's
            backend.pace.record(1.0, 1)
            backend.http.timeout = httpx.Timeout(1.0, connect=10.0)  # how the code before this test gave up
            sent.clear()
            before = probe.get("/metrics").json()["generated_tokens"]
            with pytest.raises(BackendError, match="no answer within|ReadTimeout"):
                await backend.generate(GenerateRequest(prompt_ids=[5, 6, 7], max_tokens=LONG, n=4, stop_token_ids=[]))
            return before, list(sent)
        finally:
            await backend.close()

    before, sent = asyncio.run(main())
    assert sent == ["/generate"], f"the generation was sent {len(sent)} times"
    while (m := probe.get("/metrics").json())["running"] > 0:
        time.sleep(0.05)
    generated = m["generated_tokens"] - before
    assert 0 < generated < 4 * LONG, f"{generated} tokens: the server did not stop when the client gave up"


def test_a_request_that_may_have_reached_the_server_is_not_sent_again(server):
    """A read timeout after `/pause` was sent (the server stopped, SIGSTOP): the server may have
    paused, so the request fails once, naming the server, instead of being sent again; a request
    that never left (connection refused) is tried again."""
    proc, url, secret, probe = server

    async def main():
        backend = EmbeddedBackend(url, secret)
        sent = counting(backend, "/pause")
        os.killpg(proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(BackendError, match=f"{url}/pause: ReadTimeout"):
                await backend.post("/pause", timeout=httpx.Timeout(1.0, connect=10.0))
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
            await backend.close()
        refused = EmbeddedBackend("http://127.0.0.1:9", secret)  # nothing listens on port 9
        tries = counting(refused, "/pause")
        with pytest.raises(BackendError, match="ConnectError"):
            await refused.post("/pause")
        await refused.close()
        return list(sent), list(tries)

    sent, tries = asyncio.run(main())
    assert sent == ["/pause"], f"/pause was sent {len(sent)} times after a read timeout"
    assert len(tries) == 3, "a refused connection is tried again"
    assert probe.post("/resume").status_code == 200 and probe.get("/health").status_code == 200


def test_a_deadline_grows_with_max_tokens_at_the_measured_pace():
    pace = Pace(floor_s=60.0, slack=4.0)
    assert pace.deadline(100) >= 600.0, "before any measurement: the old fixed bound"
    pace.record(2.0, 100)  # 20 ms per token
    pace.record(1.0, 100)
    assert pace.deadline(1000) == 60.0 + 4.0 * 1000 * 0.02, "floor + slack x max_tokens x the slowest recent pace"

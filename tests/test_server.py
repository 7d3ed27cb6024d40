"""The inference server as a real process on loopback: auth, generate, OpenAI completions, weights."""

import os
import signal
import time

import httpx
import pytest

from conftest import start_server
from prl.recipe.schema import Recipe


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    recipe = Recipe.model_validate({"trainer": {"router_replay": True}})  # the server captures routing
    proc, cfg, client = start_server(run_dir, recipe)
    url = f"http://{cfg.host}:{cfg.port}"
    yield client, run_dir, url
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(10)


def test_requires_secret(server):
    _, _, url = server
    assert httpx.get(f"{url}/health").status_code == 401
    assert httpx.post(f"{url}/generate", json={"prompt_ids": [5]}, headers={"Authorization": "Bearer nope"}).status_code == 401


def test_generate_returns_tokens_logprobs_versions(server):
    client, _, _ = server
    r = client.post("/generate", json={"prompt_ids": [5, 6, 7], "max_tokens": 5, "temperature": 1.0,
                                       "stop_token_ids": [], "n": 3})
    assert r.status_code == 200
    completions = r.json()["completions"]
    assert len(completions) == 3
    for body in completions:
        assert len(body["token_ids"]) == 5 and body["finish_reason"] == "length"
        assert len(body["logprobs"]) == 5 and all(lp <= 0 for lp in body["logprobs"])
        assert body["versions"] == [-1] * 5
    assert client.post("/generate", json={"prompt_ids": []}).status_code == 422


def test_a_final_request_keeps_no_kv_of_its_completions(server):
    """`final` reaches the engine: the next turn of an unmarked request reuses its prompt and completion's KV; after a
    final one, only its prompt's."""
    client, _, _ = server

    def hit_tokens(final: bool) -> int:
        prompt = [4 + (7 * i + final) % 30 for i in range(40)]  # each call its own conversation
        first = client.post("/generate", json={"prompt_ids": prompt, "max_tokens": 8, "stop_token_ids": [], "seed": 1,
                                               "final": final}).json()["completions"][0]["token_ids"]
        before = client.get("/metrics").json()["prefix_hit_tokens"]
        client.post("/generate", json={"prompt_ids": prompt + first + [9] * 5, "max_tokens": 1, "final": True})
        return client.get("/metrics").json()["prefix_hit_tokens"] - before

    assert hit_tokens(final=False) == 40 + 7
    assert hit_tokens(final=True) == 40


def test_openai_completions(server):
    client, _, _ = server
    r = client.post("/v1/completions", json={"model": "x", "prompt": "rev:abc=", "max_tokens": 4, "n": 2, "logprobs": 1})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion" and len(body["choices"]) == 2
    assert body["usage"]["prompt_tokens"] == 8
    assert sum(len(c["logprobs"]["token_logprobs"]) for c in body["choices"]) == body["usage"]["completion_tokens"]


def test_score_gives_the_logprobs_generate_sampled_them_with(server):
    """A teacher's request: the sampled tokens' logprobs in one forward, nothing generated, with the version."""
    client, _, _ = server
    r = client.post("/generate", json={"prompt_ids": [5, 6, 7], "max_tokens": 6, "temperature": 1.0,
                                       "stop_token_ids": [], "seed": 11})
    [c] = r.json()["completions"]
    s = client.post("/score", json={"items": [{"ids": [5, 6, 7, *c["token_ids"]], "start": 3}, {"ids": [5, 6]}]})
    assert s.status_code == 200 and s.json()["version"] == c["versions"][0], s.text
    assert max(abs(a - b) for a, b in zip(s.json()["logprobs"][0], c["logprobs"])) < 1e-4
    assert [len(x) for x in s.json()["logprobs"]] == [6, 1]
    bad = client.post("/score", json={"items": [{"ids": [5, 6, 7]}, {"ids": [5, 6], "start": 2}]})
    assert bad.status_code == 400 and "items[1]: start (2)" in bad.text and "at least one is scored" in bad.text

    async def through_the_client():  # what the orchestrator's client asks
        from prl.backends.embedded import EmbeddedBackend

        backend = EmbeddedBackend(str(client.base_url), client.headers["Authorization"].removeprefix("Bearer "))
        try:
            return await backend.score([([5, 6, 7, *c["token_ids"]], 3), ([5, 6], 1)])
        finally:
            await backend.close()

    import asyncio

    assert asyncio.run(through_the_client()).logprobs == s.json()["logprobs"]


def test_update_weights_good_and_bad(server, tiny_model):
    from prl.model.weights import write_weights

    client, run_dir, _ = server
    good = write_weights(run_dir / "weights" / "v3", tiny_model.state_dict(), {"version": 3})
    r = client.post("/update_weights", json={"path": str(good), "version": 3})
    assert r.status_code == 200 and r.json()["version"] == 3
    bad = dict(tiny_model.state_dict())
    bad.pop("lm_head.weight")
    broken = write_weights(run_dir / "weights" / "v4", bad, {"version": 4})
    r = client.post("/update_weights", json={"path": str(broken), "version": 4})
    assert r.status_code == 409 and "still serving v3" in r.json()["detail"]
    assert client.get("/health").json()["version"] == 3
    out = client.post("/generate", json={"prompt_ids": [5], "max_tokens": 2, "stop_token_ids": []}).json()
    assert out["completions"][0]["versions"] == [3, 3]


def test_pause_resume_and_metrics(server):
    client, _, _ = server
    assert client.post("/pause").json()["ok"]
    assert client.get("/metrics").json()["paused"] is True
    client.post("/resume")
    m = client.get("/metrics").json()
    assert m["paused"] is False and m["generated_tokens"] > 0


def test_routing_is_returned_once_per_group_and_from_offset(server):
    from prl.inference.protocol import decode_routing

    client, _, _ = server
    body = client.post("/generate", json={"prompt_ids": [5, 6, 7, 8, 9], "max_tokens": 4, "stop_token_ids": [],
                                          "n": 2, "return_routing": True, "routing_start": 2}).json()
    from prl.inference.protocol import GenerateResponse

    resp = GenerateResponse.model_validate(body)
    prompt = decode_routing(resp.prompt_routing)
    assert prompt.shape[0] == 3 and prompt.dtype.itemsize == 1  # positions 2..4 only: the client holds 0..1
    for c in resp.completions:
        assert decode_routing(c.routing).shape == (3, prompt.shape[1], prompt.shape[2])
    plain = client.post("/generate", json={"prompt_ids": [5], "max_tokens": 2}).json()
    assert plain["prompt_routing"] is None and plain["completions"][0]["routing"] is None


@pytest.mark.parametrize("path,body,status,words", [
    ("/generate", {"prompt_ids": [5, 100000]}, 400, "prompt_ids[1] = 100000 is outside the vocabulary"),
    ("/generate", {"prompt_ids": [5, -1]}, 422, "prompt_ids"),
    ("/generate", {"prompt_ids": [5] * 600}, 400, "exceeds the model's context"),
    ("/generate", {"prompt_ids": [5], "max_tokens": 10**9}, 400, "exceeds the model's context"),
    ("/generate", {"prompt_ids": [5], "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": ""}, 422, "prompt"),
    ("/v1/completions", {"prompt": []}, 422, "prompt"),
    ("/v1/completions", {"prompt": [7, 99999]}, 400, "prompt[1] = 99999"),
    ("/update_weights", {"version": 9, "path": "/etc"}, 400, "not a version folder of this run"),
])
def test_a_bad_request_fails_alone(server, path, body, status, words):
    """Each answered 4xx naming the field; the engine keeps serving everyone else."""
    client, _, _ = server
    r = client.post(path, json=body)
    assert r.status_code == status and words in r.text, r.text
    ok = client.post("/generate", json={"prompt_ids": [5, 6], "max_tokens": 2})
    assert ok.status_code == 200 and client.get("/health").status_code == 200


def test_non_finite_numbers_and_huge_bodies_are_refused(server):
    client, _, url = server
    raw = b'{"prompt_ids": [5], "temperature": NaN}'
    r = client.post("/generate", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "temperature" in r.text
    r = client.post("/generate", content=b"x" * (17 << 20), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    for doc in ("/docs", "/openapi.json"):
        assert httpx.get(url + doc).status_code in (401, 404)
    assert client.post("/generate", json={"prompt_ids": [5], "max_tokens": 1}).status_code == 200


def test_malformed_weight_folders_answer_409_and_keep_serving(server, tiny_model):
    import json

    import torch

    from prl.model.weights import MANIFEST, write_weights

    client, run_dir, _ = server
    before = client.get("/health").json()["version"]
    state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    state["lm_head.weight"][0, 0] = float("inf")
    write_weights(run_dir / "weights" / "v20", state, {"version": 20})
    garbage = write_weights(run_dir / "weights" / "v21", tiny_model.state_dict(), {"version": 21})
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
    manifest = json.loads((garbage / MANIFEST).read_text())
    from prl.model.weights import sha256

    manifest["files"]["model.safetensors"] = {"size": 64, "sha256": sha256(garbage / "model.safetensors")}
    (garbage / MANIFEST).write_text(json.dumps(manifest))
    write_weights(run_dir / "weights" / "v22", tiny_model.state_dict(), {"other": 1})  # no version in it
    escape = write_weights(run_dir / "weights" / "v23", tiny_model.state_dict(), {"version": 23})
    m = json.loads((escape / MANIFEST).read_text())
    m["files"]["../../secret"] = {"size": 1, "sha256": "0"}
    (escape / MANIFEST).write_text(json.dumps(m))
    for v, words in ((20, "non-finite"), (21, "unreadable weights"), (22, "unreadable weights"),
                     (23, "not a plain file")):
        r = client.post("/update_weights", json={"path": str(run_dir / "weights" / f"v{v}"), "version": v})
        assert r.status_code == 409 and words in r.json()["detail"], (v, r.text)
    assert client.get("/health").json()["version"] == before
    out = client.post("/generate", json={"prompt_ids": [5], "max_tokens": 2}).json()
    assert torch.isfinite(torch.tensor(out["completions"][0]["logprobs"])).all()


def test_the_official_openai_client(server):
    """As clients use it: models, completions with n and a seed (n different completions), and every
    unsupported option refused with a 400 whose message the client shows."""
    import openai

    client, run_dir, url = server
    secret = client.headers["Authorization"].removeprefix("Bearer ")
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key=secret, max_retries=0)
    assert [m.id for m in oai.models.list().data] == ["run"]
    out = oai.completions.create(model="run", prompt="rev:abc=", max_tokens=6, n=4, seed=7, temperature=1.0,
                                 logprobs=1)
    texts = [c.text for c in out.choices]
    assert len(texts) == 4 and len(set(texts)) > 1, f"n completions with one seed must differ: {texts}"
    assert all(len(c.logprobs.token_logprobs) > 0 for c in out.choices)
    echo = oai.completions.create(model="run", prompt="rev:abc=", max_tokens=0, echo=True, logprobs=0)
    [c] = echo.choices
    assert c.text == "rev:abc=" and c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == 8
    from prl.model.tiny import char_tokenizer

    scored = client.post("/score", json={"items": [{"ids": char_tokenizer()("rev:abc=").input_ids, "start": 1}]})
    assert max(abs(a - b) for a, b in zip(c.logprobs.token_logprobs[1:], scored.json()["logprobs"][0])) < 1e-5
    both = oai.completions.create(model="run", prompt="rev:abc=", max_tokens=3, echo=True, logprobs=0, seed=1,
                                  stop=None)
    assert both.choices[0].text.startswith("rev:abc=") and len(both.choices[0].logprobs.token_logprobs) >= 9
    for kwargs, words in (({"stream": True}, "stream"), ({"max_tokens": 0}, "max_tokens"), ({"best_of": 3}, "best_of"),
                          ({"logprobs": 5}, "logprobs"), ({"presence_penalty": 0.5}, "presence_penalty"),
                          ({"prompt": ""}, "prompt")):
        args = {"model": "run", "prompt": "rev:abc=", "max_tokens": 2, **kwargs}
        with pytest.raises(openai.APIStatusError) as e:
            oai.completions.create(**args)
        assert e.value.status_code in (400, 422) and words in str(e.value), str(e.value)
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="bearer token"):
        bad.models.list()


@pytest.mark.parametrize("streamed", [False, True])
def test_a_generation_stops_when_its_client_disconnects(server, streamed):
    """The engine drops the sequences of a client that went away instead of generating for nobody (a member
    stream, answered by `prl.inference.streamed`, as a whole response)."""
    import json
    import socket
    from urllib.parse import urlparse

    client, _, url = server
    before = client.get("/metrics").json()["generated_tokens"]
    u = urlparse(url)
    body = json.dumps({"prompt_ids": [5], "max_tokens": 500, "n": 4, "stop_token_ids": [],
                       "stream_members": streamed}).encode()
    s = socket.create_connection((u.hostname, u.port))
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Authorization: {client.headers['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    while client.get("/metrics").json()["running"] < 4:
        time.sleep(0.02)
    s.close()
    while (m := client.get("/metrics").json())["running"] > 0:
        time.sleep(0.02)
    assert m["generated_tokens"] - before < 4 * 500, "the whole generation ran for a client that was gone"
    assert client.post("/generate", json={"prompt_ids": [5], "max_tokens": 2}).status_code == 200


BAD_VALUES = [None, -1, 0, 2**63, 10**30, -1e308, 1e308, 0.5, "x", "", [], {}, [[1]], ["a"], [-5], [10**30],
              True, {"a": 1}, "9" * 5000]
VALID = {
    "/generate": {"prompt_ids": [5, 6], "max_tokens": 2, "temperature": 1.0, "top_p": 1.0, "n": 2, "seed": 3,
                  "stop_token_ids": [7], "return_routing": True, "routing_start": 1},
    "/generate?streamed": {"prompt_ids": [5, 6], "max_tokens": 2, "temperature": 1.0, "n": 2, "seed": 3,
                           "stop_token_ids": [7], "return_routing": True, "stream_members": True, "final": True},
    "/v1/completions": {"model": "prl", "prompt": "rev:ab=", "max_tokens": 2, "temperature": 0.5, "top_p": 1.0,
                        "n": 2, "seed": 1, "stop": ["x"], "logprobs": 1, "echo": False, "stream": False},
    "/update_weights": {"version": 1, "path": None},
    "/score": {"items": [{"ids": [5, 6, 7], "start": 1}]},
}


def mutations(body: dict):
    """Every field replaced by every bad value, every field dropped, an unknown field added."""
    for key in body:
        for value in BAD_VALUES:
            yield {**body, key: value}
        yield {k: v for k, v in body.items() if k != key}
    yield {**body, "unknown_field": 1}


@pytest.mark.parametrize("path", sorted(VALID))
def test_fuzz_sweep_never_answers_5xx_and_keeps_serving(server, path):
    """The whole class of bad input, swept per route: each mutation of a valid body is answered
    (2xx, or 4xx naming what is wrong, never 5xx), and the server keeps serving good requests."""
    client, _, _ = server
    answered = {}
    for body in mutations(VALID[path]):
        r = client.post(path.split("?")[0], json=body)
        assert r.status_code < 500, f"{path} {body!r} -> {r.status_code}: {r.text[:300]}"
        answered[r.status_code] = answered.get(r.status_code, 0) + 1
    for raw in (b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"prompt_ids": [5], "max_tokens": Infinity}'):
        r = client.post(path.split("?")[0], content=raw, headers={"Content-Type": "application/json"})
        assert 400 <= r.status_code < 500, f"{path} {raw!r} -> {r.status_code}: {r.text[:300]}"
    print(f"\n{path}: answers {answered}")
    ok = client.post("/generate", json={"prompt_ids": [5, 6], "max_tokens": 2})
    assert ok.status_code == 200 and client.get("/health").status_code == 200

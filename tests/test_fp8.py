"""Block-scaled FP8: quantisation bounds, the DeepGEMM scale layout, the FP8 linear against float64,
swapping a model's layers, and FP8 checkpoints."""

import math

import pytest
import torch

from prl.model.fp8 import (
    E4M3_MAX,
    Fp8BlockLinear,
    apply_fp8,
    backend,
    dequantize,
    fp8_linear,
    quantize_blocks,
    quantize_tiles,
)

E4M3_REL = 2.0 ** -4  # 3 mantissa bits: half an ulp is 2^-4 relative, for normal values


def test_scale_layout_matches_deep_gemm():
    x = torch.randn(300, 520)
    qa = quantize_tiles(x)
    assert qa.q.dtype == torch.float8_e4m3fn and qa.q.shape == (300, 520)
    assert qa.scale.dtype == torch.float32 and qa.scale.shape == (300, math.ceil(520 / 128))
    assert torch.allclose(qa.scale[7, 1], x[7, 128:256].abs().max() / E4M3_MAX)
    qw = quantize_blocks(x)
    assert qw.scale.shape == (math.ceil(300 / 128), math.ceil(520 / 128))
    assert torch.allclose(qw.scale[2, 4], x[256:300, 512:520].abs().max() / E4M3_MAX)


@pytest.mark.parametrize("quant", [quantize_tiles, quantize_blocks])
def test_quantise_error_is_bounded_per_block(quant):
    x = torch.randn(256, 384) * torch.logspace(-3, 3, 384)  # blocks of very different magnitudes
    q = quant(x)
    err = (dequantize(q) - x).abs()
    th, tw = q.tile
    full_scale = q.scale.repeat_interleave(th, 0)[:256].repeat_interleave(tw, 1)[:, :384]
    # each value is within half an E4M3 ulp of itself, or of the subnormal step, times its block scale
    bound = torch.maximum(x.abs() * E4M3_REL, full_scale * 2.0 ** -9)
    assert (err <= bound * 1.0001).all()
    assert (q.q.float().abs() <= E4M3_MAX).all()


def test_saturates_instead_of_overflowing():
    q = quantize_tiles(torch.tensor([[1e30, -1e30] + [1.0] * 126]))
    assert torch.isfinite(q.q.float()).all() and q.q.float().abs().max() == E4M3_MAX


@pytest.mark.parametrize("grad_scale", [1.0, 1e-10])  # gradients of a token-normalised loss are tiny
def test_fp8_linear_forward_backward_against_float64(grad_scale):
    torch.manual_seed(0)
    x = torch.randn(64, 256, requires_grad=True)
    w = (torch.randn(384, 256) * 0.05).requires_grad_()
    g = torch.randn(64, 384) * grad_scale
    y = fp8_linear(x, w)
    y.backward(g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 @ w64.T
    y64.backward(g.double())
    # each operand carries E4M3 rounding (uniform, up to 2^-4 relative: ~3.6% rms); the product's
    # relative error measures ~3.7% whatever the magnitude, since scales follow each tile
    def rel(a, b):
        return float((a.detach().double() - b.detach()).norm() / b.detach().norm())
    assert rel(y, y64) < 0.05
    assert rel(x.grad, x64.grad) < 0.05
    assert rel(w.grad, w64.grad) < 0.05
    assert rel(y, y64) > 1e-4, "the FP8 path really quantises"


def test_cached_weight_in_inference_matches_training_path():
    lin = Fp8BlockLinear.from_linear(torch.nn.Linear(256, 128))
    x = torch.randn(8, 256)
    with torch.no_grad():
        cached = lin(x)
        assert lin._qw_key[1] == lin.weight._version
    assert torch.equal(cached, lin(x).detach())


def test_only_eligible_layers_are_swapped(model_dir):
    from prl.model.build import build_model

    model = build_model(model_dir)  # hidden 128, experts 128, dense 256: MLA dims 96/64/... are not
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = apply_fp8(model)
    assert any(n.endswith("mlp.experts") for n in report["fp8"]), report
    assert any(n.endswith("shared_experts.gate_proj") for n in report["fp8"])
    assert any(n.endswith("q_a_proj") for n in report["kept"])  # 96 x 128: stays high precision
    for name, mod in model.named_modules():
        if name.endswith(("lm_head", "gate", "embed_tokens")) or "indexer" in name:
            assert not isinstance(mod, Fp8BlockLinear), name
    assert model.state_dict().keys() == before.keys()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    out = model(input_ids=ids, use_cache=False).logits
    assert torch.isfinite(out).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dispatch")
def test_cpu_uses_the_exact_reference():
    assert backend() == "reference"


def test_requantising_published_fp8_is_exact():
    """Why the engine can take published FP8 weights as they are: dequantise then quantise is the identity."""
    q = quantize_blocks(torch.randn(256, 384))
    again = quantize_blocks(dequantize(q))
    assert torch.equal(again.q.view(torch.uint8), q.q.view(torch.uint8)) and torch.equal(again.scale, q.scale)


def test_fp8_published_weights_load_into_an_fp8_engine(model_dir, tmp_path):
    from prl.inference.engine import prepare_weights
    from prl.model.build import build_model
    from prl.model.fp8_checkpoint import fp8_tensor_names, quantize_state_dict
    from prl.model.weights import write_weights

    trainer = build_model(model_dir, seed=1)
    names = fp8_tensor_names(trainer)
    path = write_weights(tmp_path / "v1", quantize_state_dict(trainer.state_dict(), names), {"version": 1})
    plain = sum(v.numel() * v.element_size() for k, v in trainer.state_dict().items() if k in names)
    assert plain / sum(trainer.state_dict()[k].numel() for k in names) == 4  # fp32 master: FP8 is a quarter
    engine = build_model(model_dir, seed=2)
    apply_fp8(engine)
    policy = prepare_weights(engine, path)
    assert policy.version == 1 and set(policy.scales) == set(names)
    policy.load_into(engine)
    lin = next(m for m in engine.modules() if isinstance(m, Fp8BlockLinear))
    name = next(n for n, m in engine.named_modules() if m is lin)
    assert torch.equal(lin.quantized_weight().q.view(torch.uint8), policy.state[name + ".weight"].view(torch.uint8))
    apply_fp8(trainer)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(engine(input_ids=ids).logits, trainer(input_ids=ids).logits, atol=1e-5)


def test_fp8_export_reads_back_identical(model_dir, tmp_path):
    from prl.model.build import build_model
    from prl.trainer.export import read_fp8, write_fp8
    from prl.model.fp8_checkpoint import dequantize_state_dict
    from prl.model.hf_format import to_checkpoint_format

    model = build_model(model_dir, seed=3)
    write_fp8(model, tmp_path / "hf")
    tensors, qc = read_fp8(tmp_path / "hf")
    assert qc["weight_block_size"] == [128, 128] and qc["fmt"] == "e4m3"
    name = next(k for k in tensors if k.endswith("shared_experts.gate_proj.weight"))
    assert tensors[name].dtype == torch.float8_e4m3fn
    want = quantize_blocks(model.state_dict()[name])
    assert torch.equal(tensors[name].view(torch.uint8), want.q.view(torch.uint8))
    assert torch.equal(tensors[name + "_scale_inv"], want.scale)
    experts = next(k for k in tensors if k.endswith("experts.0.gate_proj.weight"))  # per expert, as GLM-5-FP8
    assert tensors[experts].dtype == torch.float8_e4m3fn and tensors[experts + "_scale_inv"].shape == (1, 1)
    assert tensors["lm_head.weight"].dtype == torch.float32  # not converted
    assert {"lm_head", "model.embed_tokens"} <= set(qc["modules_to_not_convert"])
    back = dequantize_state_dict(tensors)
    want = to_checkpoint_format(model, model.state_dict())  # every key present, every shape right
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in want.items()}

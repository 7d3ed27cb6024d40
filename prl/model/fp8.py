"""Block-scaled FP8 (DeepSeek-V3 recipe): one numeric recipe for the trainer and the engine.

- values in E4M3 (max 448), rounded to nearest and saturated at +-448;
- activations (and every operand quantised along the reduction dim on the fly): one fp32 scale
  per 1x128 tile, `[M, K] -> scales [M, ceil(K/128)]`;
- weights: one fp32 scale per 128x128 block, `[N, K] -> scales [ceil(N/128), ceil(K/128)]`;
- a scale is the dequantisation multiplier `amax / 448` (what HF checkpoints call
  `weight_scale_inv`), the layout DeepGEMM's `fp8_gemm_nt` takes; accumulation is fp32;
- master weights (and the optimizer) stay in high precision; FP8 copies are made per step.

`gemm_nt(a, b)` computes `a @ b.T` from quantised operands with the first backend that exists:
DeepGEMM on a Hopper GPU, else `torch._scaled_mm` with block-wise scales on a GPU that supports
it, else the exact CPU reference (dequantise, then matmul in fp32). `backend()` says which.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prl.model import families

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128
# only keeps an all-zero tile's scale finite: gradients are routinely ~1e-8, and a larger floor
# (the 1e-4 of activation-only recipes) would round them to a handful of E4M3 steps or to zero
MIN_AMAX = 1e-30


@dataclass
class Quantized:
    """FP8 values plus fp32 scales; `tile` is (1, 128) or (128, 128)."""

    q: torch.Tensor
    scale: torch.Tensor
    tile: tuple[int, int]

    def t(self) -> "Quantized":
        """The transpose; exact for 128x128 blocks (their transposes are the blocks of W^T)."""
        if self.tile != (BLOCK, BLOCK):
            raise ValueError("only 128x128-block operands transpose without requantising")
        return Quantized(self.q.t().contiguous(), self.scale.t().contiguous(), self.tile)


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return F.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def _cast(x: torch.Tensor, scale_full: torch.Tensor) -> torch.Tensor:
    return (x / scale_full).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_tiles(x_MK: torch.Tensor) -> Quantized:
    """1x128 tiles along the last dim (activations, gradients)."""
    m, k = x_MK.shape
    kp = math.ceil(k / BLOCK) * BLOCK
    tiles = _pad_to(x_MK.float(), m, kp).view(m, kp // BLOCK, BLOCK)
    scale = tiles.abs().amax(dim=-1).clamp(min=MIN_AMAX) / E4M3_MAX  # [M, K/128]
    q = _cast(tiles, scale[..., None]).view(m, kp)[:, :k]
    return Quantized(q.contiguous(), scale, (1, BLOCK))


def quantize_blocks(w_NK: torch.Tensor) -> Quantized:
    """128x128 blocks (weights)."""
    n, k = w_NK.shape
    np_, kp = math.ceil(n / BLOCK) * BLOCK, math.ceil(k / BLOCK) * BLOCK
    blocks = _pad_to(w_NK.float(), np_, kp).view(np_ // BLOCK, BLOCK, kp // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / E4M3_MAX  # [N/128, K/128]
    q = _cast(blocks, scale[:, None, :, None]).view(np_, kp)[:n, :k]
    return Quantized(q.contiguous(), scale, (BLOCK, BLOCK))


def dequantize(x: Quantized) -> torch.Tensor:
    rows, cols = x.q.shape
    th, tw = x.tile
    full = x.scale.repeat_interleave(th, 0)[:rows].repeat_interleave(tw, 1)[:, :cols]
    return x.q.float() * full


# ---------------------------------------------------------------- GEMM backends
def _reference(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    return (dequantize(a) @ dequantize(b).t()).to(out_dtype)


def _deep_gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:  # pragma: no cover - gpu
    import deep_gemm

    out = torch.empty(a.q.shape[0], b.q.shape[0], device=a.q.device, dtype=torch.bfloat16)
    recipe = (1, 128, 128) if b.tile == (BLOCK, BLOCK) else (1, 1, 128)
    deep_gemm.fp8_gemm_nt((a.q, a.scale), (b.q, b.scale), out, recipe=recipe)
    return out.to(out_dtype)


def _scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:  # pragma: no cover - gpu
    out = torch._scaled_mm(a.q, b.q.t(), scale_a=a.scale, scale_b=b.scale.t(), out_dtype=torch.bfloat16)
    return out.to(out_dtype)


@functools.lru_cache(maxsize=None)
def backend() -> str:
    """'deep_gemm' | 'scaled_mm' | 'reference' for the current machine (cached)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        try:
            import deep_gemm  # noqa: F401

            return "deep_gemm"
        except ImportError:
            pass
        if _scaled_mm_blockwise_works():
            return "scaled_mm"
    return "reference"


def _scaled_mm_blockwise_works() -> bool:  # pragma: no cover - gpu
    try:
        a = quantize_tiles(torch.randn(128, 256, device="cuda"))
        b = quantize_blocks(torch.randn(128, 256, device="cuda"))
        ref = _reference(a, b, torch.float32)
        return torch.allclose(_scaled_mm(a, b, torch.float32), ref, rtol=2e-2, atol=1e-1)
    except (RuntimeError, TypeError):
        return False


BACKENDS = {"deep_gemm": _deep_gemm, "scaled_mm": _scaled_mm, "reference": _reference}


def gemm_nt(a: Quantized, b: Quantized, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`a @ b.T` with fp32 accumulation; a: [M, K] 1x128 tiles, b: [N, K] blocks or tiles."""
    name = backend() if a.q.is_cuda else "reference"
    return BACKENDS[name](a, b, out_dtype)


# ---------------------------------------------------------------- the linear layer
class Fp8LinearFn(torch.autograd.Function):
    """y = x W^T in FP8. Backward: dX = dY W with W's 128x128 blocks transposed (no requantising);
    dW = dY^T X with both operands in 1x128 tiles along the token dimension (the reduction)."""

    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor, qw: Quantized | None):
        qw = qw or quantize_blocks(w_NK)
        qx = quantize_tiles(x_MK)
        ctx.save_for_backward(x_MK)
        ctx.qw = qw
        return gemm_nt(qx, qw, x_MK.dtype)

    @staticmethod
    def backward(ctx, g_MN: torch.Tensor):
        (x_MK,) = ctx.saved_tensors
        dx = gemm_nt(quantize_tiles(g_MN), ctx.qw.t(), x_MK.dtype)
        dw = gemm_nt(quantize_tiles(g_MN.t()), quantize_tiles(x_MK.t()), torch.float32)
        return dx, dw, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, qw: Quantized | None = None) -> torch.Tensor:
    shape = x.shape
    y = Fp8LinearFn.apply(x.reshape(-1, shape[-1]), weight, qw)
    return y.reshape(*shape[:-1], weight.shape[0])


def eligible(out_features: int, in_features: int) -> bool:
    return out_features % BLOCK == 0 and in_features % BLOCK == 0


class Fp8BlockLinear(torch.nn.Linear):
    """A drop-in `nn.Linear` computing in block-scaled FP8 with a high-precision master weight.

    Same parameter names as `nn.Linear`, so state dicts do not change. Outside autograd (the
    engine, evaluation) the quantised weight is cached until the weight changes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qw = None if torch.is_grad_enabled() else self.quantized_weight()
        y = fp8_linear(x, self.weight, qw)
        return y if self.bias is None else y + self.bias

    def quantized_weight(self) -> Quantized:
        key = (self.weight.data_ptr(), self.weight._version)
        if getattr(self, "_qw_key", None) != key:
            self._qw, self._qw_key = quantize_blocks(self.weight.detach()), key
        return self._qw

    def load_quantized(self, qw: Quantized) -> None:
        """Serve exactly these FP8 values (published by an FP8 trainer) without requantising."""
        self.weight.data.copy_(dequantize(qw).to(self.weight.dtype))
        self._qw, self._qw_key = qw, (self.weight.data_ptr(), self.weight._version)

    @classmethod
    def from_linear(cls, lin: torch.nn.Linear) -> "Fp8BlockLinear":
        lin.__class__ = cls  # keeps the parameters, their names and any hooks
        return lin


# ---------------------------------------------------------------- swapping a model's layers
class _Fp8Experts:
    """Mixin for HF expert stacks with 3-D `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            if e >= self.num_experts:
                continue
            token, slot = torch.where(top_k_index == e)
            gate, up = fp8_linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = fp8_linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, token, (h * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def fp8_experts(mod) -> bool:
    """Whether `apply_fp8` swapped this expert stack to FP8."""
    return isinstance(mod, _Fp8Experts)


def apply_fp8(model, swap: bool = True) -> dict[str, list[str]]:
    """Swap the eligible attention/MLP linears and expert stacks of `model` to FP8, in place
    (`swap=False` only reports). Which they are is the family spec's (`prl.model.families`: its
    `fp8_linears` by leaf name, its `expert_classes`); an unknown family fails.

    Router, lm_head, embeddings, norms and the DSA indexer stay in high precision, as does any
    projection whose dimensions are not multiples of 128, and every member of a group that serving
    engines fuse into one GEMM (`fp8_fused`: q/k/v, gate/up, q_a/kv_a) unless all its members are
    eligible, so the trainer's FP8 layers are the ones vLLM can serve. Returns what was swapped and kept."""
    fam = families.spec(model.config.model_type, "FP8 (trainer.fp8 / inference.fp8)")
    experts = {id(m) for m in families.modules_of(model, fam.expert_classes)}
    linears = fp8_candidates(model, fam)
    linear_ok = fused_eligible(linears, fam.fp8_fused)
    report: dict[str, list[str]] = {"fp8": [], "kept": []}
    for name, mod in model.named_modules():
        if name in linears:
            ok = linear_ok[name]
            if ok and swap:
                Fp8BlockLinear.from_linear(mod)
        elif id(mod) in experts:
            e, two_i, h = mod.gate_up_proj.shape
            ok = eligible(two_i // 2, h)
            if ok and swap and not isinstance(mod, _Fp8Experts):
                mod.__class__ = type(f"Fp8{type(mod).__name__}", (_Fp8Experts, type(mod)), {})
        else:
            continue
        report["fp8" if ok else "kept"].append(name)
    return report


def fp8_candidates(model, fam) -> dict[str, torch.nn.Linear]:
    """The linears the family may run in FP8 (by leaf name, outside its `fp8_skip` paths), by module name."""
    return {name: mod for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in fam.fp8_linears
            and not any(s in name for s in fam.fp8_skip)}


def fused_eligible(linears: dict[str, torch.nn.Linear], groups) -> dict[str, bool]:
    """Each candidate's eligibility; a member of a fused group only when its siblings under the same
    parent module are eligible too (a sibling that is no candidate does not count)."""
    ok = {n: eligible(m.out_features, m.in_features) for n, m in linears.items()}
    out = {}
    for name, good in ok.items():
        parent, _, leaf = name.rpartition(".")
        group = next((g for g in groups if leaf in g), ())
        out[name] = good and all(ok.get(f"{parent}.{g}" if parent else g, True) for g in group)
    return out

"""LoRA: low-rank adapters on a frozen base, trained by RL and sent to the servers alone.

A target linear `X` (weight `[out, in]`) gains two trainable parameters on the same module, `X.lora_A`
`[rank, in]` and `X.lora_B` `[out, rank]`, and computes `base(x) + scale * dropout(x) @ A.T @ B.T` with
`scale = alpha / rank` (the module's class is swapped, as FP8's is, so names and hooks stay: the base weight
is still `X.weight`). `B` starts at zero, so step 0's forward is the base's exactly.

On the wire and in a published version an adapter is the pair `X.lora_A`, `X.lora_B` with the scale
folded into `B` (`B' = scale * B`): a server computes `W = W_base + B' @ A` (`merged`), keeping the base's
target weights of the version named in the manifest's `adapter.base` (`AdapterBase`). Stacked routed
experts (`[E, out, in]`) take `A` `[E, rank, in]` and `B` `[E, out, rank]` per stacked weight, on a child
module of the experts (`...experts.lora_gate_up_proj.lora_A`), computed per expert on its tokens and merged
per expert.

Which modules a group names is the model family's business (`prl.model.families.FamilySpec.lora_groups`).
"""

from __future__ import annotations

import hashlib
import math
import threading
from pathlib import Path
from typing import Callable

import torch

from prl.model import families

A, B = ".lora_A", ".lora_B"
SUFFIXES = (A, B)


class _LoraLinear:
    """Mixed into a linear's class: the base's output plus the adapter's (the base weight frozen)."""

    lora_scale: float
    lora_dropout: float
    lora_on: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if not self.lora_on:
            return out
        h = torch.nn.functional.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return out + (h @ self.lora_A.to(h.dtype).t() @ self.lora_B.to(h.dtype).t()) * self.lora_scale


class _LoraExperts:
    """Mixed into a stacked routed-experts class (`gate_up_proj [E, 2I, h]`, `down_proj [E, h, I]`): expert e's
    GEMMs add its own adapter (`lora_gate_up_proj.lora_A[e]` `[r, h]`, `.lora_B[e]` `[2I, r]`; down alike),
    computed on the tokens routed to it. The loop is transformers' reference one."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            if e >= self.num_experts:  # a dropped slot
                continue
            token, slot = torch.where(top_k_index == e)
            gate, up = self._lora_linear(hidden_states[token], "gate_up_proj", e).chunk(2, dim=-1)
            y = self._lora_linear(self.act_fn(gate) * up, "down_proj", e) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def _lora_linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        y = torch.nn.functional.linear(x, getattr(self, name)[e])
        if not self.lora_on:
            return y
        ad = getattr(self, "lora_" + name)
        h = torch.nn.functional.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return y + (h @ ad.lora_A[e].to(h.dtype).t() @ ad.lora_B[e].to(h.dtype).t()) * self.lora_scale


def target_modules(model, model_type: str, groups: list[str]) -> dict[str, torch.nn.Module]:
    """name -> module of every target in `groups` (the family's `lora_groups`; a group the family has no
    modules for, such as Qwen3-MoE's shared experts, adds none), in module order: linears, and with
    "routed_experts" the stacked experts modules."""
    spec = families.spec(model_type, "trainer.lora")
    patterns = families.linear_patterns(spec, groups)
    found = {n: m for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and any(p.search(n) for p in patterns)}
    if "routed_experts" in groups:
        experts = {id(m) for m in families.modules_of(model, spec.expert_classes)}
        found.update({n: m for n, m in model.named_modules() if id(m) in experts})
    return found


def apply_lora(model, model_type: str, rank: int, alpha: float, dropout: float, groups: list[str],
               seed: int = 0) -> list[str]:
    """Adapters on every target of `groups`, everything else frozen; returns the targets' names. Rank and
    seed fix the adapters' initial values, so every rank builds the same ones."""
    targets = target_modules(model, model_type, groups)
    if not targets:
        raise ValueError(f"trainer.lora.targets {groups}: no module of this {model_type} model matches")
    model.requires_grad_(False)
    for mod in targets.values():
        mixin = _LoraLinear if isinstance(mod, torch.nn.Linear) else _LoraExperts
        mod.__class__ = type(f"Lora{type(mod).__name__}", (mixin, type(mod)), {})
        mod.lora_scale, mod.lora_dropout, mod.lora_on = alpha / rank, dropout, True
        if mixin is _LoraLinear:
            add_pair(mod, mod.weight.shape, rank)
        else:
            for name in ("gate_up_proj", "down_proj"):
                holder = torch.nn.Module()
                add_pair(holder, getattr(mod, name).shape, rank, device=getattr(mod, name).device)
                mod.add_module("lora_" + name, holder)
    init_adapters(model, seed)
    return list(targets)


def add_pair(mod: torch.nn.Module, shape, rank: int, device=None) -> None:
    """`lora_A [.., rank, in]` and `lora_B [.., out, rank]` for a weight of `shape` `[.., out, in]` (fp32)."""
    *lead, out, inp = shape
    device = device if device is not None else mod.weight.device
    mod.lora_A = torch.nn.Parameter(torch.empty(*lead, rank, inp, device=device, dtype=torch.float32))
    mod.lora_B = torch.nn.Parameter(torch.empty(*lead, out, rank, device=device, dtype=torch.float32))


@torch.no_grad()
def init_adapters(model, seed: int) -> None:
    """A as PEFT's default (Kaiming-uniform, a = sqrt(5): bound 1/sqrt(in)), B zero; from `seed` and the
    target's name alone, so a rank holding a shard (DTensor) gets its part of the same values."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in adapter_params(model).items():
        full = torch.zeros(p.shape, dtype=p.dtype)
        if name.endswith(A):
            gen = torch.Generator().manual_seed(adapter_seed(seed, name))
            bound = 1 / math.sqrt(p.shape[-1])
            full = torch.rand(p.shape, generator=gen, dtype=torch.float64).mul(2 * bound).sub(bound).to(p.dtype)
        if isinstance(p, DTensor):
            p.copy_(distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None))
        else:
            p.copy_(full)


def adapter_seed(seed: int, name: str) -> int:
    """The generator seed of one adapter's initial values: a stable hash (not Python's salted `hash`) of the
    run's seed and the parameter's name, so every rank and every restart draws the same values, and names made
    of the same characters (layers 12 and 21) draw different ones."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little")


def freeze_base(model, dtype: str) -> None:
    """The frozen base held at the compute dtype (`trainer.dtype`; bf16: half the fp32 master weights' bytes;
    it takes no optimizer step, so it needs no fp32 copy); the adapters stay fp32."""
    if dtype == "bfloat16":
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)


def adapter_params(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if n.endswith(SUFFIXES)}


def lora_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (_LoraLinear, _LoraExperts))]


class adapters_off:
    """Within the block the model is its base (the KL reference of a LoRA run costs no second model)."""

    def __init__(self, model):
        self.mods = lora_modules(model)

    def __enter__(self):
        for m in self.mods:
            m.lora_on = False

    def __exit__(self, *exc):
        for m in self.mods:
            m.lora_on = True


def is_adapter(name: str) -> bool:
    return name.endswith(SUFFIXES)


def stem_of(name: str) -> str:
    return name.removesuffix(A).removesuffix(B)


def target_of(name: str) -> str:
    """`X.lora_A` / `X.lora_B` -> `X.weight`, the tensor the adapter changes; a stacked expert weight's
    (`...experts.lora_gate_up_proj.lora_A`) -> `...experts.gate_up_proj`."""
    head, _, leaf = stem_of(name).rpartition(".")
    return f"{head}.{leaf[5:]}" if leaf.startswith("lora_") else f"{stem_of(name)}.weight"


def wire_state(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Adapter tensors as published: B scaled (`B' = scale * B`), A as is."""
    return {k: v * scale if k.endswith(B) else v for k, v in state.items()}


def published_adapters(model, part: dict[str, torch.Tensor], hf_format: bool, scale: float) -> dict:
    """Adapters as published: B scaled (`wire_state`), named after their target weight's checkpoint name where
    `hf_format` (transformers' conversion of `X.weight`, suffix kept)."""
    part = wire_state(part, scale)
    if not hf_format:
        return part
    from prl.model.hf_format import checkpoint_name

    out = {}
    for name, t in part.items():
        target = target_of(name)
        if not target.endswith(".weight"):  # refused before a run starts (routed experts served by vLLM)
            raise ValueError(f"{target}: stacked-expert adapters are published in memory names only")
        hf = checkpoint_name(model, target)  # a dense target keeps one name
        out[hf.removesuffix(".weight") + name[len(target) - len(".weight"):]] = t
    return out


def check_adapter(adapter: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """What is wrong with an adapter version against the model's tensor shapes (empty: nothing): every
    target known and 2-D or 3-D, A and B paired, shapes `[.., r, in]` and `[.., out, r]`."""
    problems = []
    for stem in sorted({stem_of(k) for k in adapter}):
        a, b, w = adapter.get(stem + A), adapter.get(stem + B), shapes.get(target_of(stem + A))
        if w is None or len(w) not in (2, 3):
            problems.append(f"{stem}: no such target weight")
        elif a is None or b is None:
            problems.append(f"{stem}: lora_A and lora_B come in pairs")
        elif (tuple(a.shape[:-2]) != tuple(w[:-2]) or a.shape[-1] != w[-1] or b.shape[-2] != w[-2]
              or b.shape[-1] != a.shape[-2] or tuple(b.shape[:-2]) != tuple(w[:-2])):
            problems.append(f"{stem}: A {list(a.shape)} / B {list(b.shape)} do not fit {list(w)}")
    return problems


@torch.no_grad()
def merged(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`W_base + B' @ A` for every target of `adapter` (published form, scale folded into B), in fp32, at the
    base tensor's dtype; stacked ([E, out, in]) targets per expert."""
    out = {}
    for stem in sorted({stem_of(k) for k in adapter}):
        name = target_of(stem + A)
        w = base[name]
        out[name] = (w.float() + torch.matmul(adapter[stem + B].float(), adapter[stem + A].float())).to(w.dtype)
    return out


class AdapterBase:
    """A server's copy of the base's target weights, read once per base version from its sealed folder
    (`fetch(version) -> folder`); `rename` maps a published tensor name to the folder's, as for the
    adapter's targets."""

    def __init__(self, fetch: Callable[[int], Path]):
        self.fetch = fetch
        self.version: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.lock = threading.Lock()  # a server's folder reads and its collective receives share it

    def targets(self, version: int, names: set[str]) -> dict[str, torch.Tensor]:
        with self.lock:
            return self._targets(version, names)

    def _targets(self, version: int, names: set[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        from prl.model.weights import verify_dir

        if version != self.version:
            self.version, self.tensors = version, {}
        wanted = names - set(self.tensors)
        if wanted:
            folder = Path(self.fetch(version))
            manifest = verify_dir(folder, hash_only=set())
            if manifest.get("adapter") or manifest.get("streamed_only"):
                raise ValueError(f"{folder}: the base v{version} of an adapter must be a whole version")
            for file in sorted(n for n in manifest["files"] if n.endswith(".safetensors")):
                with safe_open(str(folder / file), "pt") as f:
                    for k in wanted & set(f.keys()):
                        self.tensors[k] = f.get_tensor(k)
        missing = names - set(self.tensors)
        if missing:
            raise ValueError(f"base v{version}: no tensors {sorted(missing)[:5]} for the adapter's targets")
        return {k: self.tensors[k] for k in names}

    def whole(self, version: int) -> dict[str, torch.Tensor]:
        """Every tensor of the base version (not kept: a server needs it whole once, after a restart)."""
        from prl.model.weights import read_weights

        state, manifest = read_weights(Path(self.fetch(version)))
        if manifest.get("adapter"):
            raise ValueError(f"v{version}, the base of an adapter, is an adapter version itself")
        return state

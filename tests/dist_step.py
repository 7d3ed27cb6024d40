"""Run under torchrun by tests/test_parallel.py: one training step's forward and backward of the
tiny model under a given parallel layout; rank 0 saves the loss and every full gradient.

    torchrun --nproc-per-node N tests/dist_step.py MODEL_DIR OUT.pt '{"parallel": {"ep": 2}, ...}' [--replay]
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from prl.model.build import build_model
from prl.model.families import routed_experts
from prl.model.routing import Replay, routers
from prl.recipe.schema import TrainerCfg
from prl.trainer import context_parallel
from prl.trainer.parallelize import Parallel
from prl.trainer.step import forward_backward
from prl.transport.batch import Sample, pack


def samples(layers: int, experts: int, k: int) -> list[Sample]:
    """Fixed samples (with replayed routing: k distinct experts per token and MoE layer)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        p = torch.randint(4, 40, (6 + i % 4,), generator=g).tolist()
        c = torch.randint(4, 40, (5 + i % 7,), generator=g).tolist()
        n = len(p) + len(c) - 1
        routing = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n * layers)]).view(n, layers, k)
        out.append(Sample(p, c, (-torch.rand(len(c), generator=g) * 3).tolist(), [0] * len(c),
                          float(i % 3) - 1.0, routing=routing.to(torch.uint8)))
    return out


def count_collectives(model) -> list[int]:
    """Collectives issued inside each attention module's forward (FSDP's gathers run before it, in
    the decoder layer's hooks): one entry per attention forward, in order."""
    counts: list[int] = []
    inside = []
    for name in ("all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor", "all_to_all_single",
                 "broadcast", "all_to_all"):
        original = getattr(dist, name)

        def counted(*a, _original=original, **k):
            if inside:
                counts[-1] += 1
            return _original(*a, **k)

        setattr(dist, name, counted)
    for m in model.modules():
        if type(m).__name__.endswith("GlmMoeDsaAttention"):
            def pre(mod, args, kwargs):
                if torch.is_grad_enabled() or not inside:
                    counts.append(0)
                    inside.append(1)

            def post(mod, args, kwargs, out):
                inside.clear()

            m.register_forward_pre_hook(pre, with_kwargs=True)
            m.register_forward_hook(post, with_kwargs=True)
    return counts


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def main(model_dir: str, out: str, tcfg_json: str, replay: bool) -> None:  # noqa: C901
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tcfg = TrainerCfg.model_validate(json.loads(tcfg_json))
    model = build_model(model_dir, seed=0)
    if tcfg.fp8:
        from prl.model.fp8 import apply_fp8

        apply_fp8(model)
    rp = Replay(model, replay=True) if replay else None
    cfg = model.config
    layers = len(routers(model))
    dims = tcfg.parallel.dims(dist.get_world_size()).build_meshes("cpu")
    par = Parallel(model, dims, tcfg)
    experts = routed_experts(cfg.to_dict())
    mbs = pack(samples(layers, experts, cfg.num_experts_per_tok), dims.dp_size, 64)[dims.dp_rank(dist.get_rank())]
    seq = par.seq
    if seq is None and "--cp-adapter" in sys.argv:  # prl's DSA attention on one rank (no exchange)
        seq = context_parallel.install(par.model, None, 1, 0)
    counts = count_collectives(par.model) if "--count" in sys.argv else None
    stats = forward_backward(par.model, rp, mbs, "rl", tcfg, 1.0, torch.device("cpu"), seq)
    if counts is not None:
        stats["collectives_per_attention_forward"] = counts
    par.finish_grads()
    grads = {n: full(p.grad).detach().clone() for n, p in par.model.named_parameters() if p.grad is not None}
    if dist.get_rank() == 0:
        torch.save({"stats": stats, "grads": grads}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], "--replay" in sys.argv[4:])

"""Run under torchrun (4 ranks) by tests/test_ep_dispatch.py: one MoE layer's expert-parallel forward
and backward, with each dispatch (plain, FP8, node dedup, both) on the same inputs, the 4 ranks taken
as 2 nodes of 2. Rank 0 saves, per case and rank: the output, the gradients of the input, the
routing weights and the expert stacks, and the bytes the rank sent (`ep_dispatch.TRAFFIC`).

8 experts of hidden size 256 (two 1x128 FP8 tiles a row), 2 per rank: experts 2r and 2r+1 on rank r.
Routings: "fixed", 5 tokens a rank chosen so the bytes can be counted by hand (see the test), and
"random", 48 tokens a rank with 2 distinct random experts each.

    torchrun --nproc-per-node 4 tests/dist_dispatch.py OUT.pt
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from prl.model.fp8 import dequantize, quantize_tiles
from prl.trainer import ep_dispatch
from prl.trainer.expert_parallel import make_comm, split_experts

E, D, INNER, PER_NODE = 8, 256, 64, 2
CASES = {"plain": (False, False), "fp8": (True, False), "dedup": (False, True), "fp8+dedup": (True, True)}


class Experts(torch.nn.Module):
    """Stacked SwiGLU experts as transformers' MoE families hold them."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * INNER, D, generator=g) * D ** -0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(E, D, INNER, generator=g) * INNER ** -0.5)
        self.act_fn = torch.nn.SiLU()


def fixed_ids(rank: int) -> torch.Tensor:
    """Rank p = (node n, index l): f = (other node, l) its rail peer, g = (other node, 1-l), q = (n, 1-l).
    Tokens: experts on f and g; both on g; on q and f; both on p itself; both on q."""
    n, l = divmod(rank, PER_NODE)
    f, g, q = (1 - n) * PER_NODE + l, (1 - n) * PER_NODE + 1 - l, n * PER_NODE + 1 - l
    return torch.tensor([[2 * f, 2 * g], [2 * g, 2 * g + 1], [2 * q, 2 * f], [2 * rank, 2 * rank + 1],
                         [2 * q, 2 * q + 1]])


def random_ids(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(48)])


def inputs(rank: int, ids: torch.Tensor, dtype: torch.dtype):
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(ids.shape[0], D, generator=g) * torch.logspace(-2, 1, D)  # values of many sizes in a tile
    w = torch.rand(ids.shape, generator=g)
    probe = torch.randn(ids.shape[0], D, generator=g)
    return x.to(dtype), w, probe


def run(mesh: DeviceMesh, ids: torch.Tensor, dtype: torch.dtype, fp8: bool, dedup: bool, rounded: bool) -> dict:
    """One forward and backward; `rounded`: the input passed through FP8's rounding first."""
    rank = dist.get_rank()
    x, w, probe = inputs(rank, ids, dtype)
    if rounded:
        x = dequantize(quantize_tiles(x)).to(dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)
    experts = Experts().to(dtype)
    params = split_experts(experts, mesh, make_comm(mesh, PER_NODE, fp8, dedup))
    ep_dispatch.TRAFFIC.clear()
    out = experts(x, ids, w)
    (out.float() * probe).sum().backward()
    full = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params]
    return {"out": out.detach(), "x_grad": x.grad, "w_grad": w.grad, "expert_grads": full,
            "traffic": dict(ep_dispatch.TRAFFIC)}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", torch.arange(dist.get_world_size()))
    results = {}
    for routing, ids in (("fixed", fixed_ids(rank)), ("random", random_ids(rank))):
        for dtype in (torch.float32, torch.bfloat16):
            for case, (fp8, dedup) in CASES.items():
                results[(routing, str(dtype), case)] = run(mesh, ids, dtype, fp8, dedup, False)
            results[(routing, str(dtype), "plain, rounded input")] = run(mesh, ids, dtype, False, False, True)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, results)
    if rank == 0:
        torch.save(every, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

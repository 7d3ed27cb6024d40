"""Run under torchrun by tests/test_overlap.py and bench/comm_overlap.py: training steps of a tiny MoE
model with the exchanges overlapped and serial, alternating, each case its own model from the same
weights on the same batch. Per case, rank 0 saves what tests/dist_step.py saves of its first step
(loss, gradients, norm, weights after AdamW: `assert_same_step`) and, for every step, its wall time
(whole, and its forward and backward alone: `fb_s`) and this rank's exchange seconds in flight and
exposed (`prl.trainer.overlap.CLOCK`).

    torchrun ... tests/dist_overlap.py MODEL_DIR OUT.pt '{"cases": {"overlap": {"parallel": {"ep": 2}}, ...},
        "steps": 3, "samples": 8, "length": 40}'

Each case is a TrainerCfg (its `parallel` table included); `timeout_s` is the process group's timeout. Prints "step N" on rank 0 as each step
starts (a test kills a rank once it has seen one).
"""

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from dist_step import GradsWhenFinished, full

from prl.model.build import build_model
from prl.model.families import routed_experts
from prl.model.routing import routers
from prl.recipe.schema import TrainerCfg
from prl.trainer.overlap import CLOCK
from prl.trainer.parallelize import Parallel
from prl.trainer.step import forward_backward
from prl.trainer.trainer import Trainer
from prl.transport.batch import Sample, pack


def batch(n: int, length: int, layers: int, experts: int, k: int) -> list[Sample]:
    """n samples of `length` tokens (half prompt, half completion), with replayed routing."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        p, c = torch.randint(4, 40, (length // 2,), generator=g).tolist(), torch.randint(4, 40, (length // 2,), generator=g).tolist()
        routing = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range((length - 1) * layers)])
        out.append(Sample(p, c, (-torch.rand(len(c), generator=g) * 3).tolist(), [0] * len(c), float(i % 3) - 1.0,
                          routing=routing.view(length - 1, layers, k).to(torch.uint8)))
    return out


class Case:
    """One layout: its model, optimizer and what its steps measured."""

    def __init__(self, model_dir: str, cfg: dict):
        from types import SimpleNamespace

        self.tcfg = TrainerCfg.model_validate({**cfg, "lr": 1e-3})
        self.dims = self.tcfg.parallel.dims(dist.get_world_size()).build_meshes("cpu")
        self.par = Parallel(build_model(model_dir, seed=0), self.dims, self.tcfg)
        self.trainer = SimpleNamespace(par=self.par, model=self.par.model, tcfg=self.tcfg)
        self.opt, self.sched = Trainer.make_optimizer(self.trainer, self.tcfg.lr, 1)
        self.seen = {"step_s": [], "fb_s": [], "comm_s": [], "exposed_comm_s": [], "forward_s": [],
                     "forward_comm_s": [], "forward_exposed_s": []}
        self.first: dict | None = None

    def step(self, data: list[Sample]) -> None:
        mbs = pack(data, self.dims.dp_size, self.tcfg.micro_batch_tokens)[self.dims.dp_rank(dist.get_rank())]
        before = None if self.first else {n: full(p).detach().clone() for n, p in self.par.model.named_parameters()}
        dist.barrier()
        CLOCK.reset()
        t = time.perf_counter()
        stats = forward_backward(self.par.model, None, mbs, "rl", self.tcfg, 1.0, torch.device("cpu"), self.par.seq)
        fb = time.perf_counter() - t
        comm, exposed = CLOCK.figures()
        fwd = CLOCK.forward_figures()
        # the first step keeps its finished gradients (collectives: that step is the warm-up, not measured)
        self.trainer.par = GradsWhenFinished(self.par) if self.first is None else self.par
        norm = Trainer.optimizer_step(self.trainer, self.opt, self.sched)
        dist.barrier()
        for key, v in (("step_s", time.perf_counter() - t), ("fb_s", fb), ("comm_s", comm), ("exposed_comm_s", exposed),
                       *zip(("forward_s", "forward_comm_s", "forward_exposed_s"), fwd)):
            self.seen[key].append(v)
        if self.first is None:
            params = {n: full(p).detach().clone() for n, p in self.par.model.named_parameters()}
            self.first = {"stats": stats, "grads": self.trainer.par.grads, "grad_norm": norm, "params": params,
                          "moved": sorted(n for n, p in params.items() if not torch.equal(p, before[n]))}


def main(model_dir: str, out: str, spec: dict) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.get("timeout_s", 600)))
    torch.set_num_threads(1)
    cases = {name: Case(model_dir, cfg) for name, cfg in spec["cases"].items()}
    model = next(iter(cases.values())).par.model
    cfg = model.config
    data = batch(spec.get("samples", 8), spec.get("length", 40), len(routers(model)),
                 routed_experts(cfg.to_dict()), cfg.num_experts_per_tok)
    for s in range(spec.get("steps", 1)):
        for case in cases.values():
            if dist.get_rank() == 0:
                print(f"step {s}", flush=True)
            case.step(data)
    if dist.get_rank() == 0:
        torch.save({name: {**c.first, **c.seen} for name, c in cases.items()}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))

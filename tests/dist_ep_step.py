"""Run under torchrun (4 ranks) by tests/test_ep_dispatch.py: one training step of the tiny model at
ep = 4, the ranks taken as 2 nodes of 2, once per expert dispatch given, in one process group (one
start for all of them). Each step is the trainer's own (forward and backward, finished gradients,
the global norm, AdamW) on a fresh model, as tests/dist_step.py takes it; rank 0 saves, per dispatch,
what dist_step.py saves for `assert_same_step`, and the bytes every rank sent.

    torchrun --nproc-per-node 4 tests/dist_ep_step.py MODEL_DIR OUT.pt '{"plain": {}, "dedup": {"ep_node_dedup": true}}'
"""

import json
import sys

import torch
import torch.distributed as dist
from dist_step import full, run_cases, samples, stepped

from prl.model.build import build_model
from prl.model.families import routed_experts
from prl.model.routing import routers
from prl.recipe.schema import TrainerCfg
from prl.trainer import ep_dispatch
from prl.trainer.expert_parallel import AheadShared
from prl.trainer.parallelize import Parallel
from prl.trainer.step import forward_backward
from prl.transport.batch import pack


def one_step(model_dir: str, parallel: dict) -> dict:
    """`parallel`: the case's trainer.parallel keys, and `activation_checkpointing` if it sets it."""
    top = {k: parallel.pop(k) for k in ("activation_checkpointing",) if k in parallel}
    tcfg = TrainerCfg.model_validate({"parallel": {"ep": 4, "ep_ranks_per_node": 2, **parallel}, **top})
    model = build_model(model_dir, seed=0)
    data = samples(len(routers(model)), routed_experts(model.config.to_dict()), model.config.num_experts_per_tok)
    dims = tcfg.parallel.dims(dist.get_world_size()).build_meshes("cpu")
    par = Parallel(model, dims, tcfg)
    mbs = pack(data, dims.dp_size, 64)[dims.dp_rank(dist.get_rank())]
    before = {n: full(p).detach().clone() for n, p in par.model.named_parameters()}
    ep_dispatch.TRAFFIC.clear()
    stats = forward_backward(par.model, None, mbs, "rl", tcfg, 1.0, torch.device("cpu"), None)
    traffic = dict(ep_dispatch.TRAFFIC)
    shared = [m for m in par.model.modules() if isinstance(m, AheadShared)]
    ahead = {"modules": len(shared), "left": sum(m._prl_ahead is not None for m in shared)}
    result = stepped(par, tcfg, stats, before)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, traffic)
    return {**result, "traffic": every, "ahead": ahead}


if __name__ == "__main__":
    run_cases(one_step, sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))

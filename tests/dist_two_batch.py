"""Run under torchrun by tests/test_two_batch.py: one training step of a tiny MoE model per case, each case a
fresh model from the same weights on the same samples, in one process group (one start for all). A case is
`{"trainer": {...TrainerCfg...}, "replay": bool}`; rank 0 saves per case what tests/dist_step.py saves for
`assert_same_step`, and per rank how many layer forwards ran in two halves (`prl.trainer.two_batch.SPLIT`).

    torchrun --nproc-per-node 2 tests/dist_two_batch.py MODEL_DIR OUT.pt '{"serial": {"trainer": {...}}, ...}'
"""

import json
import sys

import torch
import torch.distributed as dist
from dist_step import full, run_cases, samples, stepped

from prl.model.build import build_model
from prl.model.families import routed_experts
from prl.model.routing import Replay, routers
from prl.recipe.schema import TrainerCfg
from prl.trainer import two_batch
from prl.trainer.parallelize import Parallel
from prl.trainer.step import forward_backward
from prl.transport.batch import pack


def one_step(model_dir: str, case: dict) -> dict:
    tcfg = TrainerCfg.model_validate(case["trainer"])
    model = build_model(model_dir, seed=0)
    replay = Replay(model) if case.get("replay") else None
    data = samples(len(routers(model)), routed_experts(model.config.to_dict()), model.config.num_experts_per_tok)
    dims = tcfg.parallel.dims(dist.get_world_size()).build_meshes("cpu")
    par = Parallel(model, dims, tcfg)
    mbs = pack(data, dims.dp_size, case.get("micro_batch_tokens", 64))[dims.dp_rank(dist.get_rank())]
    before = {n: full(p).detach().clone() for n, p in par.model.named_parameters()}
    two_batch.SPLIT.clear()
    stats = forward_backward(par.model, replay, mbs, "rl", tcfg, 1.0, torch.device("cpu"), par.seq)
    split: list = [None] * dist.get_world_size()
    dist.all_gather_object(split, dict(two_batch.SPLIT))
    metas = {m._prl_comm.group_for("meta") is not m._prl_comm.group
             for m in par.model.modules() if hasattr(m, "_prl_comm")}
    return {**stepped(par, tcfg, stats, before), "split": split, "meta": metas}


if __name__ == "__main__":
    run_cases(one_step, sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))

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
from dist_step import full, optimizer_step, samples

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
    grads, grad_norm = optimizer_step(par, tcfg)
    params = {n: full(p).detach().clone() for n, p in par.model.named_parameters()}
    metas = {m._prl_comm.group_for("meta") is not m._prl_comm.group
             for m in par.model.modules() if hasattr(m, "_prl_comm")}
    return {"stats": stats, "grads": grads, "grad_norm": grad_norm, "params": params, "split": split, "meta": metas,
            "moved": sorted(n for n in params if not torch.equal(params[n], before[n]))}


def main(model_dir: str, out: str, cases: dict) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {name: one_step(model_dir, case) for name, case in cases.items()}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))

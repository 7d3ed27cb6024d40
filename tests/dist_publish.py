"""Run under torchrun (2 ranks) by tests/test_publish.py: three training steps of a tiny MoE model at ep 2 (its
weights sharded by FSDP2 and by expert parallelism), each version published before the step that changes it,
twice from the same weights and batch: `serial` publishes it inline, then steps; `background` freezes its parts
(`parts_of(..., frozen=True)`) and publishes them on the trainer's background thread over a process group of its
own, the thread held until the step changed the weights (so only the frozen copy has the version's values).

    torchrun --nproc-per-node 2 tests/dist_publish.py MODEL_DIR ROOT
"""

import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from dist_step import samples

from prl.model.build import build_model
from prl.model.families import routed_experts
from prl.model.routing import routers
from prl.recipe.schema import TrainerCfg
from prl.trainer.parallelize import Parallel
from prl.trainer.publish import Background, parts_of, publish
from prl.trainer.step import forward_backward
from prl.transport.batch import pack
from prl.transport.sinks import FolderSink
from prl.model.policy import WHOLE


def run(model_dir: str, root: Path, background: bool) -> None:
    tcfg = TrainerCfg.model_validate({"parallel": {"ep": 2}, "lr": 1e-2})
    model = build_model(model_dir, seed=0)
    data = samples(len(routers(model)), routed_experts(model.config.to_dict()), model.config.num_experts_per_tok)
    dims = tcfg.parallel.dims(dist.get_world_size()).build_meshes("cpu")
    par = Parallel(model, dims, tcfg)
    opt = torch.optim.AdamW(par.model.parameters(), lr=tcfg.lr)
    mbs = pack(data, dims.dp_size, 64)[dims.dp_rank(dist.get_rank())]
    sink, group, bg = FolderSink(root, keep=5), dist.new_group(backend="gloo"), Background()
    for version in range(1, 4):
        stepped = threading.Event()
        if background:
            parts = parts_of(par.model, WHOLE, frozen=True)

            def job(version=version, parts=parts, stepped=stepped):
                stepped.wait()  # the weights have moved on: only the frozen copy holds this version
                publish(par.model, sink, version, parts=parts, group=group)

            bg.submit(job)
        else:
            publish(par.model, sink, version)
        forward_backward(par.model, None, mbs, "rl", tcfg, 1.0, torch.device("cpu"), None)
        par.finish_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stepped.set()
    bg.wait()


def main(model_dir: str, root: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for mode in ("serial", "background"):
        run(model_dir, Path(root) / mode, mode == "background")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

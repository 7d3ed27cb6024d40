"""Run under torchrun (2 ranks, gloo) by test_trainer: a sharded checkpoint saved and loaded where
each rank has its own path to the checkpoint folder (argv: mode, rank 0's root, rank 1's root,
out). Each rank writes what happened to out.rank<N>.json."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from prl.trainer.checkpoint import load_checkpoint, save_checkpoint


def model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def main(mode: str, roots: list[str], out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = Path(roots[rank])
    result = {}
    try:
        if mode == "save":
            model, opt = model_and_optimizer(0)
            model(torch.randn(3, 8)).sum().backward()
            opt.step()
            path = save_checkpoint(model, opt, root, 5, 40, sharded=True)
            result["path"] = str(path) if path else None
            result["sum"] = sum(p.full_tensor().sum().item() for p in model.parameters())
        else:
            model, opt = model_and_optimizer(1)  # other weights: the load must replace them
            meta = load_checkpoint(model, opt, root)
            result["step"] = meta["step"]
            result["sum"] = sum(p.full_tensor().sum().item() for p in model.parameters())
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        result["error"] = f"{type(e).__name__}: {e}"
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    # leave without the interpreter's teardown, as the trainer does: a C++ thread of torch.distributed
    # can abort a finished rank there (SIGABRT, "terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:4], sys.argv[4])

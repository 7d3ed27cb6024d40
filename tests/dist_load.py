"""Run under torchrun by tests/test_parallel.py: load a pretrained folder into the trainer's model
(sharded: the trainer's own `setup_model`, meta build and each rank reads its rows; or whole:
`from_pretrained` on every rank; FP8 layers with `"fp8": true`), then
the logprobs of a fixed sequence; rank 0 saves them with each rank's peak resident memory growth.

    torchrun --nproc-per-node N tests/dist_load.py FOLDER OUT.pt sharded|whole '{"parallel": {...}}'
"""

import json
import resource
import sys

import torch
import torch.distributed as dist


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(folder: str, out: str, mode: str, tcfg_json: str) -> None:
    from prl.model.build import build_model
    from prl.model.fp8 import apply_fp8
    from prl.recipe.schema import TrainerCfg
    from prl.trainer import head
    from prl.trainer.model_setup import setup_model
    from prl.trainer.parallelize import Parallel

    import transformers.models.auto.modeling_auto  # noqa: F401  (imports before the baseline)

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tcfg = TrainerCfg.model_validate(json.loads(tcfg_json))
    base = peak_mb()
    dims = tcfg.parallel.dims(dist.get_world_size()).build_meshes("cpu")
    if mode == "sharded":
        par = setup_model(folder, tcfg, dims, torch.device("cpu")).par
    else:
        model = build_model(folder)
        if tcfg.fp8:
            apply_fp8(model)
        par = Parallel(model, dims, tcfg)
    loaded = peak_mb() - base
    ids = torch.arange(3, 40)
    with torch.no_grad(), head.targets(par.model, ids[1:], 1.0, 0):
        logp = par.model(input_ids=ids[None, :-1], use_cache=False).logits[0, :, 0]
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, loaded)
    if dist.get_rank() == 0:
        torch.save({"logp": logp, "load_peak_mb": peaks}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])

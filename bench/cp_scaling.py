"""Context parallelism on CPU: one long packed row through a GLM-5-architecture model at cp = 1, 2, 4
(real torchrun ranks, gloo): time per training step, peak memory growth per rank, and the bytes
each rank exchanges per attention layer against what a naive all-gather of the expanded keys and
values would move (and the same two figures for GLM-5's own dimensions).

    .venv/bin/python bench/cp_scaling.py [--tokens 2048] [--steps 3] [--cps 1 2 4]

Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def gathered_bytes(c: dict, tokens: int, size: int, cb: int = 4) -> tuple[float, float]:
    """(prl's exchange, a naive K/V exchange) per rank per attention layer, forward."""
    prl = (c["kv_lora_rank"] + c["qk_rope_head_dim"] + c["index_head_dim"]) * cb
    naive = c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) * cb
    received = tokens * (size - 1) / size
    return prl * received, naive * received


def worker(model_dir: str, out: str, tokens: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from prl.model.build import build_model
    from prl.recipe.schema import TrainerCfg
    from prl.trainer.parallelize import Parallel
    from prl.trainer.step import forward_backward
    from prl.transport.batch import Sample, pack

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cp = dist.get_world_size()
    tcfg = TrainerCfg.model_validate({"parallel": {"cp": cp}, "micro_batch_tokens": tokens + 1})
    model = build_model(model_dir, seed=0)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    par = Parallel(model, tcfg.parallel.dims(dist.get_world_size()).build_meshes("cpu"), tcfg)
    g = torch.Generator().manual_seed(0)
    per = tokens // 4  # four samples packed in the row
    samples = [Sample(torch.randint(4, 40, (per // 2,), generator=g).tolist(), torch.randint(4, 40, (per // 2 + 1,), generator=g).tolist(),
                      [-1.0] * (per // 2 + 1), [0] * (per // 2 + 1), 1.0) for _ in range(4)]
    mbs = pack(samples, 1, tokens + 1)[0]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        forward_backward(par.model, None, mbs, "rl", tcfg, 1.0, torch.device("cpu"), par.seq)
        par.model.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    peaks = [None] * cp
    dist.all_gather_object(peaks, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"cp": cp, "step_s": statistics.median(times), "peak_mb": max(peaks)}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker[0], a.worker[1], int(a.worker[2]), int(a.worker[3]))
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    tmp = Path(tempfile.mkdtemp())
    cfg = ModelCfg(hidden_size=128, num_layers=2, first_dense_layers=0, index_topk=64, max_position_embeddings=a.tokens + 8)
    model_dir = write_model_dir(cfg, tmp / "model")
    config = json.loads((model_dir / "config.json").read_text())
    rows = []
    for cp in a.cps:
        out = tmp / f"cp{cp}.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}", __file__,
                        "--worker", str(model_dir), str(out), str(a.tokens), str(a.steps)], check=True, capture_output=True)
        r = json.loads(out.read_text())
        r["exchanged_kb"], r["naive_kb"] = (b / 1024 for b in gathered_bytes(config, a.tokens, cp))
        rows.append(r)
    from transformers import GlmMoeDsaConfig

    glm5 = GlmMoeDsaConfig().to_dict()
    ours, naive = gathered_bytes(glm5, 131072, 8, cb=2)
    print(f"{a.tokens} tokens in one packed row (4 samples), tiny GLM-5 architecture, index_topk 64:")
    print("  cp   step s   peak MB/rank   exchanged KB/layer/rank   naive K/V KB")
    for r in rows:
        print(f"  {r['cp']:>2}  {r['step_s']:7.2f}  {r['peak_mb']:13.1f}  {r['exchanged_kb']:24.1f}  {r['naive_kb']:12.1f}")
    print(f"GLM-5 at 131072 tokens, cp 8, bf16: {ours / 2**20:.0f} MiB per layer per rank, naive {naive / 2**20:.0f} MiB "
          f"({naive / ours:.0f}x more)")
    print(json.dumps({"tokens": a.tokens, "rows": rows, "glm5_cp8_mib": round(ours / 2**20, 1),
                      "glm5_naive_mib": round(naive / 2**20, 1)}))


if __name__ == "__main__":
    main()

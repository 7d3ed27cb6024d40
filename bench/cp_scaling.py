"""Context parallelism on CPU, contiguous against zigzag (`trainer.parallel.cp_layout`).

1. From the masks (no model): for one sample filling a row of `--mask-tokens` tokens and for packed
   rows of random samples, the (query, key) pairs each rank's causal mask allows
   (`Sequence.allowed`) and the pairs its attention computes (each block of local queries against
   the keys up to its last query), max over ranks / mean, at cp = 2, 4, 8, 16.
2. Measured (real torchrun ranks, gloo, a tiny GLM-5-architecture model): one sample of `--tokens`
   tokens filling the packed row, at cp = 1 and, per layout, cp = 2 and 4: time per training step,
   peak memory growth per rank, the CPU time each rank spends in the DSA indexer's scoring and the
   attention (forward; thread CPU time, so 4 ranks sharing 2 cores still count their own work), and
   the bytes each rank exchanges per attention layer against a naive gather of expanded keys and
   values (and the same two figures for GLM-5's own dimensions).

    .venv/bin/python bench/cp_scaling.py [--tokens 2048] [--steps 3] [--cps 2 4] [--mask-tokens 4096]

Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = ("contiguous", "zigzag")


def gathered_bytes(c: dict, tokens: int, size: int, cb: int = 4) -> tuple[float, float]:
    """(prl's exchange, a naive K/V exchange) per rank per attention layer, forward."""
    prl = (c["kv_lora_rank"] + c["qk_rope_head_dim"] + c["index_head_dim"]) * cb
    naive = c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) * cb
    received = tokens * (size - 1) / size
    return prl * received, naive * received


def imbalance(per_rank: list[float]) -> float:
    """Max over ranks / mean: how long every rank waits for the slowest, as a factor."""
    return max(per_rank) * len(per_rank) / sum(per_rank)


def mask_pairs(segments, size: int, layout: str) -> tuple[list[int], list[int]]:
    """Per rank: the pairs its causal mask allows and the pairs its attention computes."""
    from prl.trainer.context_parallel import Sequence, sequence
    from prl.transport.batch import shard_positions

    allowed, computed = [], []
    for r in range(size):
        seq = Sequence(None, size, r, layout)
        with sequence(seq, segments, shard_positions(len(segments), r, size, layout)):
            allowed.append(int(seq.allowed().sum()))
            computed.append(sum((b - a) * keys for a, b, keys in seq.blocks))
    return allowed, computed


def random_packed_row(n: int, rng: random.Random):
    """Sample ids of a row of n tokens packed with samples of 1..n/2 tokens (the last one cut to fit)."""
    import torch

    lengths = []
    while sum(lengths) < n:
        lengths.append(min(rng.randint(1, n // 2), n - sum(lengths)))
    return torch.cat([torch.full((k,), i) for i, k in enumerate(lengths)])


def from_masks(n: int, cps: list[int], rows: int = 10) -> list[dict]:
    import torch

    out = []
    for cp in cps:
        r = {"cp": cp}
        for layout in LAYOUTS:
            allowed, computed = mask_pairs(torch.zeros(n, dtype=torch.long), cp, layout)
            rng = random.Random(0)
            packed = [imbalance(mask_pairs(random_packed_row(n, rng), cp, layout)[0]) for _ in range(rows)]
            r[layout] = {"allowed": round(imbalance(allowed), 3), "computed": round(imbalance(computed), 3),
                         "packed_allowed": round(statistics.mean(packed), 3)}
        out.append(r)
    return out


def timed(fn, acc: list[float]):
    """`fn`, adding the thread CPU time it takes to acc[0]."""
    def run(*a, **k):
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            acc[0] += time.thread_time() - t0
    return run


def worker(model_dir: str, out: str, tokens: int, steps: int, layout: str) -> None:
    import torch
    import torch.distributed as dist

    from prl.model.build import build_model
    from prl.recipe.schema import TrainerCfg
    from prl.trainer import context_parallel
    from prl.trainer.parallelize import Parallel
    from prl.trainer.step import forward_backward
    from prl.transport.batch import Sample, pack

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cp = dist.get_world_size()
    tcfg = TrainerCfg.model_validate({"parallel": {"cp": cp, "cp_layout": layout}, "micro_batch_tokens": tokens + 1})
    model = build_model(model_dir, seed=0)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    par = Parallel(model, tcfg.parallel.dims(dist.get_world_size()).build_meshes("cpu"), tcfg)
    seq = par.seq or context_parallel.install(par.model, None, 1, 0)  # cp 1: the same attention, no exchange
    attn = [0.0]
    context_parallel.select = timed(context_parallel.select, attn)
    context_parallel.attend_sparse = timed(context_parallel.attend_sparse, attn)
    g = torch.Generator().manual_seed(0)
    sample = Sample(torch.randint(4, 40, (tokens // 2,), generator=g).tolist(), torch.randint(4, 40, (tokens // 2 + 1,), generator=g).tolist(),
                    [-1.0] * (tokens // 2 + 1), [0] * (tokens // 2 + 1), 1.0)
    mbs = pack([sample], 1, tokens + 1)[0]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        forward_backward(par.model, None, mbs, "rl", tcfg, 1.0, torch.device("cpu"), seq)
        par.model.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    per_rank = [None] * cp
    dist.all_gather_object(per_rank, ((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024, attn[0] / steps))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"cp": cp, "layout": layout, "step_s": statistics.median(times),
                                         "peak_mb": max(p for p, _ in per_rank),
                                         "attn_cpu_s": [round(a, 4) for _, a in per_rank]}))
    dist.destroy_process_group()


def measured(a, tmp: Path) -> list[dict]:
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    cfg = ModelCfg(hidden_size=128, num_layers=2, first_dense_layers=0, index_topk=64, max_position_embeddings=a.tokens + 8)
    model_dir = write_model_dir(cfg, tmp / "model")
    config = json.loads((model_dir / "config.json").read_text())
    rows = []
    for cp, layout in [(1, "zigzag")] + [(cp, layout) for cp in a.cps for layout in LAYOUTS]:
        out = tmp / f"cp{cp}-{layout}.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}", __file__,
                        "--worker", str(model_dir), str(out), str(a.tokens), str(a.steps), layout], check=True,
                       capture_output=True)
        r = json.loads(out.read_text())
        r["attn_imbalance"] = round(imbalance(r["attn_cpu_s"]), 3)
        r["exchanged_kb"], r["naive_kb"] = (b / 1024 for b in gathered_bytes(config, a.tokens, cp))
        rows.append(r)
    return rows


def report(a, masks: list[dict], rows: list[dict]) -> None:
    print(f"From the masks, {a.mask_tokens}-token row: max over ranks / mean of (query, key) pairs")
    print("  cp   contiguous: allowed computed packed   zigzag: allowed computed packed   2cp/(cp+1)")
    for m in masks:
        c, z = m["contiguous"], m["zigzag"]
        print(f"  {m['cp']:>2}   {c['allowed']:19.3f} {c['computed']:8.3f} {c['packed_allowed']:6.3f}"
              f"   {z['allowed']:15.3f} {z['computed']:8.3f} {z['packed_allowed']:6.3f}   {2 * m['cp'] / (m['cp'] + 1):10.3f}")
    print(f"\nMeasured: one sample of {a.tokens} tokens filling the row, tiny GLM-5 architecture, index_topk 64, gloo:")
    print("  cp  layout       step s   peak MB/rank   indexer+attention CPU s per rank (max/mean)   exchanged KB   naive KB")
    for r in rows:
        ranks = " ".join(f"{s:.3f}" for s in r["attn_cpu_s"])
        print(f"  {r['cp']:>2}  {r['layout'] if r['cp'] > 1 else '-':<11} {r['step_s']:7.2f}  {r['peak_mb']:13.1f}   "
              f"{ranks:>34} ({r['attn_imbalance']:.2f})   {r['exchanged_kb']:12.1f}   {r['naive_kb']:8.1f}")


def headline(a, masks: list[dict], rows: list[dict], glm5: tuple[float, float]) -> dict:
    attn = {f"cp{r['cp']}_{r['layout']}": r["attn_imbalance"] for r in rows if r["cp"] > 1}
    return {"mask_tokens": a.mask_tokens, "tokens": a.tokens,
            "pairs_imbalance": {f"cp{m['cp']}_{lay}": m[lay]["computed"] for m in masks for lay in LAYOUTS},
            "allowed_pairs_imbalance": {f"cp{m['cp']}_{lay}": m[lay]["allowed"] for m in masks for lay in LAYOUTS},
            "packed_rows_imbalance": {f"cp{m['cp']}_{lay}": m[lay]["packed_allowed"] for m in masks for lay in LAYOUTS},
            "attn_cpu_imbalance": attn, "rows": rows,
            "glm5_cp8_mib": round(glm5[0] / 2**20, 1), "glm5_naive_mib": round(glm5[1] / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mask-tokens", type=int, default=4096)
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker[0], a.worker[1], int(a.worker[2]), int(a.worker[3]), a.worker[4])
    from transformers import GlmMoeDsaConfig

    masks = from_masks(a.mask_tokens, [2, 4, 8, 16])
    rows = measured(a, Path(tempfile.mkdtemp()))
    report(a, masks, rows)
    glm5 = gathered_bytes(GlmMoeDsaConfig().to_dict(), 131072, 8, cb=2)
    print(f"GLM-5 at 131072 tokens, cp 8, bf16: {glm5[0] / 2**20:.0f} MiB per layer per rank, naive {glm5[1] / 2**20:.0f} MiB "
          f"({glm5[1] / glm5[0]:.0f}x more)")
    print(json.dumps(headline(a, masks, rows, glm5)))


if __name__ == "__main__":
    main()

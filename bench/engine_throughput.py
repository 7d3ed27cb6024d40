"""Embedded engine (continuous batching) against transformers' `model.generate` (static batches).

Same model, same requests, same CPU, one after the other in one process. Output lengths are
long-tailed (log-normal, clipped): each request must produce exactly its length (EOS ignored), so
both sides do the same useful work; `generate` runs the requests in static batches of the same
size as the engine's batch, each batch lasting as long as its longest member.

    .venv/bin/python bench/engine_throughput.py [--requests 96] [--batch 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from prl.inference.engine import EngineCore, SamplingParams, Sequence
from prl.model.build import build_model
from prl.model.tiny import write_model_dir
from prl.recipe.schema import ModelCfg


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(4, 40) for _ in range(rng.randint(6, 14))]
        length = max(1, min(160, int(rng.lognormvariate(2.6, 0.9))))
        reqs.append((prompt, length))
    return reqs


def run_engine(model, reqs, batch: int) -> float:
    core = EngineCore(model, max_batch_size=batch, prefix_cache_entries=0)
    t0 = time.perf_counter()
    for prompt, n in reqs:
        core.add(Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=())))
    while core.has_work():
        core.step()
    return time.perf_counter() - t0


@torch.no_grad()
def run_generate(model, reqs, batch: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(n for _, n in chunk),
                       min_new_tokens=max(n for _, n in chunk), do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(write_model_dir(ModelCfg(), Path(tempfile.mkdtemp()) / "model")).eval()
    reqs = workload(args.requests)
    useful = sum(n for _, n in reqs)
    lengths = sorted(n for _, n in reqs)
    print(f"{len(reqs)} requests, output lengths p50 {lengths[len(lengths) // 2]} p90 {lengths[int(len(lengths) * .9)]} "
          f"max {lengths[-1]}, {useful} tokens, batch {args.batch}, {args.threads} thread(s)")
    run_engine(model, reqs[:4], args.batch)  # warm up both paths
    run_generate(model, reqs[:4], args.batch)
    eng, gen = [], []
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both
        eng.append(run_engine(model, reqs, args.batch))
        gen.append(run_generate(model, reqs, args.batch))
    e, g = useful / min(eng), useful / min(gen)
    print(f"embedded engine : {e:8.0f} tokens/s")
    print(f"model.generate  : {g:8.0f} tokens/s")
    print(f"ratio engine/generate: {e / g:.2f}x")


if __name__ == "__main__":
    main()

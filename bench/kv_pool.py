"""Prefill with the KV pool against prefill without it, side by side in one run.

A real `mooncake_master` over TCP on loopback; two embedded engines on the same weights, each its own
pool client (as two servers of a run). Engine A prefills N prompts that share a long prefix (a system
prompt, a multi-turn history) and differ in their last tokens, putting their chunks into the pool;
engine B then prefills the same prompts loading the pooled chunks, and engine C (no pool) computes
them whole. Reports time per prompt for B and C, their ratio, the tokens B computed, and the pooled
bytes per token. Last line: JSON.

    .venv/bin/python bench/kv_pool.py [--prefix 1536] [--suffix 32] [--prompts 8] [--chunk 256]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prefill_all(core, prompts: list[list[int]]) -> float:
    from prl.inference.engine import SamplingParams, Sequence

    t0 = time.perf_counter()
    for p in prompts:
        seq = Sequence(list(p), SamplingParams(temperature=0.0, max_tokens=1))
        core.add(seq)
        while seq.finish_reason is None:
            core.step()
    return (time.perf_counter() - t0) / len(prompts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=1536)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()

    import torch

    from prl.inference.engine import EngineCore
    from prl.inference.kv_master import MasterAddress, healthy, master_command
    from prl.inference.kv_pool import KvPool
    from prl.model.build import build_model
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    torch.set_num_threads(2)
    length = args.prefix + args.suffix
    cfg = ModelCfg(hidden_size=256, num_layers=4, num_heads=8, max_position_embeddings=length + 64, index_topk=256)
    model_dir = write_model_dir(cfg, Path(tempfile.mkdtemp()) / "model")
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 40, (args.prefix,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 40, (args.suffix,), generator=g).tolist() for _ in range(args.prompts)]
    addr = MasterAddress("127.0.0.1", free_port(), free_port(), free_port())
    master = subprocess.Popen(master_command(addr), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not healthy(addr):
            time.sleep(0.1)

        def engine(pooled: bool) -> EngineCore:
            pool = KvPool.connect(master=addr.master, metadata=addr.metadata, hostname="127.0.0.1",
                                  segment_bytes=512 << 20, run="bench", chunk_tokens=args.chunk) if pooled else None
            core = EngineCore(build_model(model_dir, seed=1), prefix_cache_entries=0, pool=pool)
            prefill_all(core, [[4, 5, 6]])  # learns its cache layout
            return core

        a, b, c = engine(True), engine(True), engine(False)
        prefill_all(a, prompts)
        computed = b.stats.prefill_tokens
        t_pool = prefill_all(b, prompts)
        computed = (b.stats.prefill_tokens - computed) / len(prompts)
        t_plain = prefill_all(c, prompts)
        bytes_per_token = chunk_bytes(b, prompts[0], args.chunk) / args.chunk
        for core in (a, b):
            core.pool.close()  # before the master goes
    finally:
        master.terminate()
        master.wait(30)
    report = {"prompt_tokens": length, "chunk": args.chunk, "prompts": args.prompts,
              "pooled_ms": round(t_pool * 1e3, 1), "computed_ms": round(t_plain * 1e3, 1),
              "speedup": round(t_plain / t_pool, 2), "tokens_computed_with_pool": computed,
              "pooled_kib_per_token": round(bytes_per_token / 1024, 2)}
    print(f"prompt {length} tokens ({args.prefix} shared), chunks of {args.chunk}, {args.prompts} prompts")
    print(f"  prefill computing everything: {report['computed_ms']:8.1f} ms per prompt")
    print(f"  prefill from the KV pool:     {report['pooled_ms']:8.1f} ms per prompt "
          f"({computed:.0f} tokens computed)  -> {report['speedup']}x")
    print(json.dumps(report))


def chunk_bytes(core, prompt: list[int], chunk: int) -> int:
    from prl.inference.kv_pool import chunk_keys

    return core.pool.store.get_size(chunk_keys(core.pool.run, core.version, prompt, chunk)[0])


if __name__ == "__main__":
    sys.exit(main())

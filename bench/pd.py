"""Prefill/decode disaggregation against colocated servers, side by side in one run, on the same cores.

Two embedded engines, each its own process with one thread (one core each), a real `mooncake_master`
over TCP on loopback. The workload: `--streams` short-prompt decode streams kept running (a finished
one is replaced), and a long prompt (each a different one) arriving every `--every` seconds, which
wants a few tokens too.

- colocated (no pool): both engines decode half the streams; the long prompts alternate between
  them, and each long prefill stalls the decode steps of the engine that runs it.
- split: engine P only prefills the long prompts into the pool (`prefill_only`); engine D decodes
  every stream and continues each long prompt from its pooled chunks (computing only the tail).

Reported per mode: inter-token latency of the decode streams (p50, p99, max), decode tokens/s over
the window, and the long prompts' time to first token. Last line: JSON.

    .venv/bin/python bench/pd.py [--seconds 20] [--streams 8] [--long 1536] [--every 2.0] [--chunk 256]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import random
import sys
import tempfile
import time
from pathlib import Path

SHORT, STREAM_TOKENS, LONG_TOKENS = 16, 48, 4


def worker(model_dir: str, pool_cfg: dict | None, inbox, outbox) -> None:
    """One engine on one core. Inbox: (kind, tag, prompt, max_tokens, prefill_only) or None to stop.
    Outbox: (kind, tag, token times, prefill_only) per finished sequence."""
    import torch

    from prl.inference.engine import EngineCore, SamplingParams, Sequence
    from prl.inference.kv_pool import KvPool
    from prl.model.build import build_model

    torch.set_num_threads(1)
    pool = KvPool.connect(**pool_cfg) if pool_cfg else None
    core = EngineCore(build_model(model_dir, seed=1), prefix_cache_entries=0, pool=pool, max_batch_size=64)
    warm = Sequence([4, 5, 6], SamplingParams(temperature=0.0, max_tokens=1))
    core.add(warm)
    while warm.finish_reason is None:
        core.step()
    outbox.put(("ready", None, [], False))
    live: dict[int, tuple] = {}
    while True:
        items = drain(inbox, block=not live)
        if any(i is None for i in items):
            break
        for kind, tag, prompt, max_tokens, only in items:
            seq = Sequence(prompt, SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=tag))
            seq.prefill_only = only
            core.add(seq)
            live[seq.id] = (seq, kind, tag, [])
        core.step()
        now = time.perf_counter()
        for sid, (seq, kind, tag, times) in list(live.items()):
            times.extend([now] * (len(seq.out_ids) - len(times)))
            if seq.finish_reason is not None:
                outbox.put((kind, tag, times, seq.prefill_only))
                del live[sid]
    if pool is not None:
        pool.close()


def drain(inbox, block: bool) -> list:
    """Everything waiting in `inbox` (waiting for a first item when `block`)."""
    items = []
    try:
        items.append(inbox.get() if block else inbox.get_nowait())
        while True:
            items.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return items


def run_mode(mode: str, args, model_dir: str, pool_cfg: dict) -> dict:
    ctx = mp.get_context("spawn")
    inboxes, outbox = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    pool = pool_cfg | {"run": mode} if mode == "split" else None  # colocated: no pool at all
    procs = [ctx.Process(target=worker, args=(model_dir, pool, inboxes[i], outbox)) for i in range(2)]
    for p in procs:
        p.start()
    for _ in procs:
        assert outbox.get(timeout=600)[0] == "ready"
    decode = [0, 1] if mode == "colocated" else [1]  # engines that decode the streams
    tags = iter(range(1, 1 << 30))

    def stream(engine: int) -> None:
        prompt = [3 + (next(tags) * 7 + i) % 37 for i in range(SHORT)]
        inboxes[engine].put(("stream", next(tags), prompt, STREAM_TOKENS, False))

    for i in range(args.streams):
        stream(decode[i % len(decode)])
    itl, ttft, stream_tokens, longs = [], [], 0, 0
    start = time.perf_counter()
    next_long, arrived = start + args.every, {}
    while time.perf_counter() - start < args.seconds:
        now = time.perf_counter()
        if now >= next_long:
            tag = next(tags)
            rng = random.Random(tag)  # every long prompt its own: none is found in the pool
            prompt = [rng.randrange(3, 40) for _ in range(args.long)]
            arrived[tag] = (now, prompt)
            target = longs % 2 if mode == "colocated" else 0
            inboxes[target].put(("long", tag, prompt, LONG_TOKENS if mode == "colocated" else 1, mode == "split"))
            longs += 1
            next_long += args.every
        try:
            kind, tag, times, prefilled = outbox.get(timeout=max(0.0, min(0.05, next_long - now)))
        except queue.Empty:
            continue
        if kind == "stream":
            itl += [b - a for a, b in zip(times, times[1:])]
            stream_tokens += len(times)
            stream(decode[tag % len(decode)])
        elif prefilled:  # split: the prompt's KV is in the pool: D continues it
            inboxes[1].put(("long", tag, arrived[tag][1], LONG_TOKENS, False))
        else:
            ttft.append(times[0] - arrived[tag][0])
    wall = time.perf_counter() - start
    for q in inboxes:
        q.put(None)
    for p in procs:
        p.join(60)
    return summary(itl, ttft, stream_tokens, wall)


def summary(itl: list[float], ttft: list[float], tokens: int, wall: float) -> dict:
    def pct(xs, q):
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 1) if xs else None

    return {"itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99), "itl_max_ms": pct(itl, 1.0),
            "decode_tokens_per_s": round(tokens / wall, 1), "long_ttft_p50_ms": pct(ttft, 0.5),
            "long_prompts_answered": len(ttft)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long", type=int, default=1536)
    ap.add_argument("--every", type=float, default=2.0)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()

    from prl.inference.kv_master import spawn_master
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    cfg = ModelCfg(hidden_size=256, num_layers=4, num_heads=8, max_position_embeddings=args.long + 64, index_topk=256)
    model_dir = str(write_model_dir(cfg, Path(tempfile.mkdtemp()) / "model"))
    master, addr = spawn_master()
    try:
        pool_cfg = {"master": addr.master, "metadata": addr.metadata, "hostname": "127.0.0.1",
                    "segment_bytes": 256 << 20, "chunk_tokens": args.chunk}
        report = {mode: run_mode(mode, args, model_dir, pool_cfg) for mode in ("colocated", "split")}
    finally:
        master.terminate()
        master.wait(30)
    print(f"{args.streams} decode streams, a {args.long}-token prompt every {args.every:g} s, "
          f"{args.seconds:g} s per mode, 2 engines on 1 core each")
    for mode, r in report.items():
        print(f"  {mode:9s} ITL p50 {r['itl_p50_ms']} ms, p99 {r['itl_p99_ms']} ms, max {r['itl_max_ms']} ms; "
              f"{r['decode_tokens_per_s']} decode tokens/s; long prompts' TTFT p50 {r['long_ttft_p50_ms']} ms "
              f"({r['long_prompts_answered']} answered)")
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())

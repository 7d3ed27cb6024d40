"""Prefill with the KV pool against prefill without it, side by side in one run.

A real `mooncake_master` over TCP on loopback; embedded engines on the same weights, each its own pool
client (as the servers of a run), against the same number of engines without a pool. Three workloads:

- prefix: N prompts sharing a long prefix (a system prompt) and differing in their last tokens;
  engine A computes them into the pool, engine B loads the chunks, engine C (no pool) computes them.
- groups: GRPO groups of 8 whose members are spread over S servers (member j on server j % S, as a
  balancer splitting large groups would; prl itself sends a group to one server). Each server keeps
  its own prefix cache, so without the pool every server that gets a member computes the prompt once.
- turns: multi-turn conversations, each turn's prompt the whole history plus the new turn, turn t of
  conversation c on server (c + t) % S. Without the pool no server has the history (the local prefix
  cache matches whole prompts); with it only the new tokens are computed.

For groups and turns: prompt tokens computed over all servers, and time (the sum of every server's
prefill time; the step's time if the servers ran side by side is the largest server's, also shown).
Last line: JSON.

    .venv/bin/python bench/kv_pool.py [--prefix 1536] [--suffix 32] [--prompts 8] [--chunk 256]
                                      [--servers 2 4] [--groups 3] [--turns 4] [--turn-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


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
    ap.add_argument("--servers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=256)
    args = ap.parse_args()

    import torch

    from prl.inference.kv_master import spawn_master
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    torch.set_num_threads(2)
    longest = max(args.prefix + args.suffix, args.turns * args.turn_tokens)
    cfg = ModelCfg(hidden_size=256, num_layers=4, num_heads=8, max_position_embeddings=longest + 64, index_topk=256)
    model_dir = write_model_dir(cfg, Path(tempfile.mkdtemp()) / "model")
    master, addr = spawn_master()
    engines = []

    def engine(pooled: bool, run: str, prefix_cache: int = 0):
        from prl.inference.engine import EngineCore
        from prl.inference.kv_pool import KvPool
        from prl.model.build import build_model

        pool = KvPool.connect(master=addr.master, metadata=addr.metadata, hostname="127.0.0.1",
                              segment_bytes=256 << 20, run=run, chunk_tokens=args.chunk) if pooled else None
        core = EngineCore(build_model(model_dir, seed=1), prefix_cache_entries=prefix_cache, pool=pool)
        prefill_all(core, [[4, 5, 6]])  # learns its cache layout
        engines.append(core)
        return core

    try:
        report = {"chunk": args.chunk, "prefix": prefix_workload(args, engine)}
        for n in args.servers:
            report[f"groups_{n}"] = spread(engine, n, f"groups{n}", group_requests(args, n))
            report[f"turns_{n}"] = spread(engine, n, f"turns{n}", turn_requests(args, n))
    finally:
        for core in engines:
            if core.pool is not None:
                core.pool.close()  # before the master goes
        master.terminate()
        master.wait(30)
    print_report(args, report)
    print(json.dumps(report))


def prefix_workload(args, engine) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 40, (args.prefix,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 40, (args.suffix,), generator=g).tolist() for _ in range(args.prompts)]
    a, b, c = engine(True, "prefix"), engine(True, "prefix"), engine(False, "prefix")
    prefill_all(a, prompts)
    a.pool.flush()  # puts are a worker's: all in before B looks
    computed = b.stats.prefill_tokens
    t_pool = prefill_all(b, prompts)
    computed = (b.stats.prefill_tokens - computed) / len(prompts)
    t_plain = prefill_all(c, prompts)
    return {"prompt_tokens": args.prefix + args.suffix, "prompts": args.prompts,
            "pooled_ms": round(t_pool * 1e3, 1), "computed_ms": round(t_plain * 1e3, 1),
            "speedup": round(t_plain / t_pool, 2), "tokens_computed_with_pool": computed,
            "pooled_kib_per_token": round(chunk_bytes(b, prompts[0], args.chunk) / args.chunk / 1024, 2)}


def group_requests(args, servers: int) -> list[tuple[int, list[int]]]:
    """(server, prompt) for every member of every group: member j of a group on server j % S."""
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(args.groups):
        prompt = torch.randint(3, 40, (args.prefix + args.suffix,), generator=g).tolist()
        out += [(j % servers, prompt) for j in range(8)]
    return out


def turn_requests(args, servers: int) -> list[tuple[int, list[int]]]:
    """(server, prompt) for every turn: the history so far plus the new turn, turn t of
    conversation c on server (c + t) % S. Conversations run turn by turn, interleaved."""
    import torch

    g = torch.Generator().manual_seed(2)
    histories = [[] for _ in range(args.groups)]
    out = []
    for t in range(args.turns):
        for c, history in enumerate(histories):
            history += torch.randint(3, 40, (args.turn_tokens,), generator=g).tolist()
            out.append(((c + t) % servers, list(history)))
    return out


def spread(engine, servers: int, run: str, requests: list[tuple[int, list[int]]]) -> dict:
    """The requests on `servers` engines with the pool and on as many without it (each with its own
    prefix cache): prompt tokens computed and prefill time, per side."""
    out = {}
    for pooled in (False, True):
        cores = [engine(pooled, run, prefix_cache=64) for _ in range(servers)]
        busy = [0.0] * servers
        computed = sum(c.stats.prefill_tokens for c in cores)
        for server, prompt in requests:
            busy[server] += prefill_all(cores[server], [prompt])
            if pooled:
                cores[server].pool.flush()  # the next request may be another server's: as a later step would
        side = "pool" if pooled else "no_pool"
        out[side] = {"tokens_computed": sum(c.stats.prefill_tokens for c in cores) - computed,
                     "prefill_s": round(sum(busy), 2), "largest_server_s": round(max(busy), 2)}
        for c in cores:  # done with them: their pool memory back before the next workload
            if c.pool is not None:
                c.pool.close()
                c.pool = None
    out["prompt_tokens"] = sum(len(p) for _, p in requests)
    out["tokens_ratio"] = round(out["no_pool"]["tokens_computed"] / max(out["pool"]["tokens_computed"], 1), 2)
    out["time_ratio"] = round(out["no_pool"]["prefill_s"] / out["pool"]["prefill_s"], 2)
    return out


def print_report(args, report: dict) -> None:
    p = report["prefix"]
    print(f"prefix: prompt {p['prompt_tokens']} tokens ({args.prefix} shared), chunks of {args.chunk}, "
          f"{p['prompts']} prompts")
    print(f"  prefill computing everything: {p['computed_ms']:8.1f} ms per prompt")
    print(f"  prefill from the KV pool:     {p['pooled_ms']:8.1f} ms per prompt "
          f"({p['tokens_computed_with_pool']:.0f} tokens computed)  -> {p['speedup']}x")
    for n in args.servers:
        for kind, what in (("groups", f"{args.groups} groups of 8, {args.prefix + args.suffix}-token prompts"),
                           ("turns", f"{args.groups} conversations x {args.turns} turns of {args.turn_tokens} tokens")):
            r = report[f"{kind}_{n}"]
            print(f"{kind} over {n} servers ({what}; {r['prompt_tokens']} prompt tokens):")
            for side in ("no_pool", "pool"):
                s = r[side]
                print(f"  {side:8s} {s['tokens_computed']:7d} tokens computed  {s['prefill_s']:7.2f} s prefill "
                      f"(largest server {s['largest_server_s']:.2f} s)")
            print(f"  -> {r['tokens_ratio']}x fewer tokens, {r['time_ratio']}x less prefill time")


def chunk_bytes(core, prompt: list[int], chunk: int) -> int:
    from prl.inference.kv_pool import chunk_keys

    return core.pool.store.get_size(chunk_keys(core.pool.run, core.version, prompt, chunk)[0])


if __name__ == "__main__":
    sys.exit(main())

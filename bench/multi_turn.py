"""Prefill tokens per turn of multi-turn conversations: longest-prefix reuse against exact-prompt-only.

An agent sends, at every turn, its whole history as token ids: the first prompt, each completion, and
the environment's tokens after it. Conversations run side by side in one embedded engine (GLM-5's
tiny architecture, DSA indexer on), `--turns` turns each; a turn is `--completion` sampled tokens
then `--env` environment tokens appended as ids, so the history grows by `completion + env` tokens
per turn. Two engines on the same weights, one after the other in one run:

- reuse: the engine's prefix cache (`prl.inference.prefix_cache`), longest prefix over prompt and
  generated tokens: turn k+1 computes the environment tokens and the last sampled token (never fed
  back at turn k);
- exact: the same cache restricted to whole repeated prompts, as prl's cache was before (no prompt
  repeats in this workload, so every turn computes its whole history).

With `--vllm`, the same conversations (a tiny Qwen3-MoE: vLLM cannot run GLM-5's DSA on CPU) also go
to a real vLLM server (`prefix caching` on, block size 32, prl's client as the orchestrator uses it):
its prefill per turn is its prompt tokens less its prefix-cache hits (`vllm:prompt_tokens_total`,
`vllm:prefix_cache_hits_total`), whole blocks only.

Both embedded sides must sample the same tokens (greedy). Prefill tokens are the engine's `prefill_tokens`
(tokens computed, not reused); times are CPU seconds (process time, one thread), per conversation
for prefill and per turn of all conversations (prefill and decode) for the turn. Headline figures
exclude turn 1 (both compute the first prompt).
Last line: one JSON object.

    .venv/bin/python bench/multi_turn.py [--turns 8] [--conversations 4] [--prompt 256]
                                         [--completion 64] [--env 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from prl.inference.engine import EngineCore, SamplingParams, Sequence
from prl.inference.prefix_cache import PrefixCache


class ExactPromptCache(PrefixCache):
    """prl's former cache: a prompt's KV and last logits, reused only by the same whole prompt."""

    def lookup(self, version, ids):
        hit = super().lookup(version, ids)
        return hit if hit is not None and hit.logits is not None and len(hit.entry.ids) == len(ids) else None

    def insert(self, version, ids, cache, routing, logits=None, pooled=0, replaces=None):
        if not logits:  # a finished sequence's KV: the old cache kept prompts only
            return None
        return super().insert(version, ids, cache, routing, logits, pooled)


def timed_prefill(core: EngineCore) -> list[float]:
    """Wrap the engine's prefills (one prompt, or the prompts admitted together in one batch): the list
    returned collects the CPU seconds of each (process time, not wall: the machine is shared, and this
    bench runs one thread)."""
    spent = []

    def timed(fn):
        def wrapped(*args):
            t0 = time.process_time()
            try:
                return fn(*args)
            finally:
                spent.append(time.process_time() - t0)
        return wrapped

    core._prefill, core._prefill_batch = timed(core._prefill), timed(core._prefill_batch)
    return spent


def run(core: EngineCore, args) -> dict:
    """Every conversation's turns; per turn: tokens computed and prefill CPU seconds per conversation,
    the turn's CPU seconds (prefill and decode), the history's length."""
    g = torch.Generator().manual_seed(0)
    prefill_s = timed_prefill(core)
    histories = [torch.randint(4, 40, (args.prompt,), generator=g).tolist() for _ in range(args.conversations)]
    computed, seconds, prefill, lengths, outputs = [], [], [], [], []
    for _ in range(args.turns):
        before, t0, n0 = core.stats.prefill_tokens, time.process_time(), len(prefill_s)
        seqs = [Sequence(list(h), SamplingParams(temperature=0.0, max_tokens=args.completion)) for h in histories]
        for s in seqs:
            core.add(s)
        while core.has_work():
            core.step()
        seconds.append(time.process_time() - t0)
        prefill.append(sum(prefill_s[n0:]) / args.conversations)
        computed.append((core.stats.prefill_tokens - before) / args.conversations)
        lengths.append(len(histories[0]))
        outputs.append([s.out_ids for s in seqs])
        histories = [h + s.out_ids + torch.randint(4, 40, (args.env,), generator=g).tolist()
                     for h, s in zip(histories, seqs)]
    return {"prefill_per_turn": computed, "turn_s": seconds, "prefill_s": prefill, "history": lengths, "outputs": outputs,
            "cache_entries": len(core.prefix), "cache_tokens": core.prefix.tokens}


def later(xs: list[float]) -> float:
    return statistics.mean(xs[1:]) if len(xs) > 1 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--env", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vllm", action="store_true", help="also a vLLM server (its prefill per turn)")
    args = ap.parse_args()
    from prl.model.build import build_model
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    torch.set_num_threads(args.threads)
    longest = args.prompt + args.turns * (args.completion + args.env)
    cfg = ModelCfg(num_layers=2, max_position_embeddings=longest + 64, index_topk=256)
    model = build_model(write_model_dir(cfg, Path(tempfile.mkdtemp()) / "model"), seed=0)
    sides = {}
    for name, cache in (("reuse", PrefixCache(256)), ("exact", ExactPromptCache(256))):
        core = EngineCore(model, max_batch_size=args.conversations)
        core.prefix = cache
        sides[name] = run(core, args)
    vllm = vllm_side(args, longest) if args.vllm else None
    report(args, sides, vllm)


def vllm_side(args, longest: int) -> list[float]:
    """Prefill tokens per turn and conversation on a real vLLM server (prompt tokens less cache hits)."""
    import asyncio
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_vllm import call, metrics_of, wait_served
    from vllm_rig import start_server

    from prl.inference.protocol import GenerateRequest
    from prl.model.build import build_model
    from prl.model.tiny import char_tokenizer, write_model_dir
    from prl.recipe.schema import ModelCfg

    root = Path(tempfile.mkdtemp())
    model = build_model(write_model_dir(ModelCfg(arch="qwen3_moe", max_position_embeddings=longest + 64), root / "m"))
    model.save_pretrained(root / "hf")
    char_tokenizer().save_pretrained(root / "hf")
    srv = start_server(root, root / "hf", inference__max_batch_size=args.conversations,
                       inference__vllm={"max_model_len": longest + 64, "kv_cache_memory_bytes": 256 << 20})

    async def turns(b) -> list[float]:
        async def counters():
            m = metrics_of(await b.http.get("/metrics"))
            return m.get("vllm:prompt_tokens_total", 0.0), m.get("vllm:prefix_cache_hits_total", 0.0)

        g = torch.Generator().manual_seed(0)
        histories = [torch.randint(4, 40, (args.prompt,), generator=g).tolist() for _ in range(args.conversations)]
        out = []
        for _ in range(args.turns):
            p0, h0 = await counters()
            resps = await asyncio.gather(*(b.generate(GenerateRequest(
                prompt_ids=h, max_tokens=args.completion, temperature=0.0, n=1,
                stop_token_ids=[])) for h in histories))
            p1, h1 = await counters()
            out.append(((p1 - p0) - (h1 - h0)) / args.conversations)
            histories = [h + r.completions[0].token_ids + torch.randint(4, 40, (args.env,), generator=g).tolist()
                         for h, r in zip(histories, resps)]
        return out

    try:
        wait_served(srv)
        return call(srv, turns)
    finally:
        srv.stop()


def report(args, sides: dict, vllm: list[float] | None = None) -> None:
    new = args.completion + args.env
    print(f"{args.conversations} conversations x {args.turns} turns; first prompt {args.prompt}, each turn "
          f"+{args.completion} sampled +{args.env} environment tokens ({new} new)")
    print("turn  history  prefill tokens/conv: reuse  exact   prefill s/conv: reuse  exact   turn s: reuse  exact")
    r, e = sides["reuse"], sides["exact"]
    for t in range(args.turns):
        print(f"{t + 1:4d}  {r['history'][t]:7d}  {r['prefill_per_turn'][t]:26.0f}  {e['prefill_per_turn'][t]:5.0f}"
              f"   {r['prefill_s'][t]:21.3f}  {e['prefill_s'][t]:5.3f}   {r['turn_s'][t]:13.2f}  {e['turn_s'][t]:5.2f}")
    reuse, exact = later(r["prefill_per_turn"]), later(e["prefill_per_turn"])
    print(f"reuse cache at the end: {r['cache_entries']} entries, {r['cache_tokens']} tokens")
    extra = {}
    if vllm is not None:
        print("vLLM prefill tokens/conv per turn: " + " ".join(f"{x:.0f}" for x in vllm))
        extra = {"prefill_per_turn_vllm": round(later(vllm), 1), "vllm_over_new_tokens": round(later(vllm) / new, 3),
                 "vllm_over_reuse": round(later(vllm) / reuse, 3)}
    print(json.dumps({
        "turns": args.turns, "new_tokens_per_turn": new, "env_tokens_per_turn": args.env,
        "prefill_per_turn_reuse": round(reuse, 1), "prefill_per_turn_exact": round(exact, 1),
        "reuse_over_new_tokens": round(reuse / new, 3), "reuse_over_env_tokens": round(reuse / args.env, 3),
        "exact_over_reuse": round(exact / reuse, 2),
        "prefill_s_reuse": round(later(r["prefill_s"]), 4), "prefill_s_exact": round(later(e["prefill_s"]), 4),
        "exact_over_reuse_prefill_s": round(later(e["prefill_s"]) / later(r["prefill_s"]), 2),
        "turn_s_reuse": round(later(r["turn_s"]), 3), "turn_s_exact": round(later(e["turn_s"]), 3),
        "same_tokens": r["outputs"] == e["outputs"], **extra,
    }))


if __name__ == "__main__":
    main()

"""vLLM, the embedded engine (continuous batching) and transformers' `model.generate` (static batches).

Same weights (a tiny Qwen3-MoE saved as a Hugging Face folder), same requests, same CPU, one after
the other. Output lengths are long-tailed (log-normal, clipped): each request must produce exactly
its length (EOS ignored), so every side does the same useful work; `generate` runs the requests in
static batches of the engine's batch size, each lasting as long as its longest member; vLLM gets all
requests at once over HTTP (`/inference/v1/generate`, as prl's orchestrator sends them) with
`max_num_seqs` = the batch size. vLLM's worker computes on one core (it keeps the other for its API
server); the embedded engine and `generate` run one thread.

Then the same requests on reverse-tiny's GLM-5 model (MLA with a DSA indexer; vLLM's CPU build does
not serve it), embedded engine against `generate` only: there the engine's decode steps attend in
MLA's latent space (`prl.model.mla`) while transformers' forward, which `generate` runs, expands the
whole cache into per-head keys and values at every step (`glm5_*` in the JSON line).

    .venv/bin/python bench/engine_throughput.py [--requests 96] [--batch 32] [--repeats 2] [--no-vllm] [--no-glm5]
"""

from __future__ import annotations

import argparse
import json
import asyncio
import sys
import random
import tempfile
import time
from pathlib import Path

import torch

from prl.inference.engine import EngineCore, SamplingParams, Sequence
from prl.model.build import build_model
from prl.model.tiny import char_tokenizer, write_model_dir
from prl.recipe.schema import ModelCfg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(4, 40) for _ in range(rng.randint(6, 14))]
        length = max(1, min(160, int(rng.lognormvariate(2.6, 0.9))))
        reqs.append((prompt, length))
    return reqs


def run_engine(model, reqs, batch: int, compiled: bool = False, latent: bool = True, lean: bool = True) -> float:
    core = EngineCore(model, max_batch_size=batch, prefix_cache_entries=0, compiled=compiled, latent_decode=latent,
                      lean=lean)
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


def vllm_server(model, batch: int):
    """A real vLLM server on the same weights, started as `prl run` starts one."""
    from vllm_rig import start_server

    root = Path(tempfile.mkdtemp())
    model.save_pretrained(root / "hf")
    char_tokenizer().save_pretrained(root / "hf")
    srv = start_server(root, root / "hf", inference__max_batch_size=batch)
    backend = make_vllm(srv)
    try:
        asyncio.run(backend_ready(backend))
    except BaseException:
        srv.stop()
        raise
    return srv


def make_vllm(srv):
    from prl.backends.registry import make_backend

    return make_backend("vllm", srv.url, srv.secret, max_connections=256)


async def backend_ready(backend) -> None:
    try:
        await backend.wait_ready(600)
    finally:
        await backend.close()


def run_vllm(srv, reqs) -> float:
    from prl.inference.protocol import GenerateRequest

    async def go() -> float:
        backend = make_vllm(srv)
        try:
            t0 = time.perf_counter()
            await asyncio.gather(*(backend.generate(GenerateRequest(prompt_ids=p, max_tokens=n, temperature=0.0,
                                                                    stop_token_ids=[])) for p, n in reqs))
            return time.perf_counter() - t0
        finally:
            await backend.close()

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="leave out the engine with compiled decode steps")
    ap.add_argument("--no-glm5", action="store_true", help="leave out the GLM-5 model's engine and generate")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(write_model_dir(ModelCfg(arch="qwen3_moe"), Path(tempfile.mkdtemp()) / "model")).eval()
    srv = None if args.no_vllm else vllm_server(model, args.batch)
    reqs = workload(args.requests)
    useful = sum(n for _, n in reqs)
    lengths = sorted(n for _, n in reqs)
    print(f"{len(reqs)} requests, output lengths p50 {lengths[len(lengths) // 2]} p90 {lengths[int(len(lengths) * .9)]} "
          f"max {lengths[-1]}, {useful} tokens, batch {args.batch}, {args.threads} thread(s)")
    try:
        run_engine(model, reqs[:4], args.batch)  # warm up every path
        run_generate(model, reqs[:4], args.batch)
        compile_s = None
        if not args.no_compile:  # what the server's start pays (EngineCore.warm_up), not in the timings
            t0 = time.perf_counter()
            core = EngineCore(model, max_batch_size=args.batch, prefix_cache_entries=0, compiled=True)
            core.warm_up()
            compile_s = time.perf_counter() - t0
        if srv:
            run_vllm(srv, reqs[:4])
        eng, hf, com, gen, vll = [], [], [], [], []
        for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits all
            eng.append(run_engine(model, reqs, args.batch))
            hf.append(run_engine(model, reqs, args.batch, lean=False))
            if compile_s is not None:
                com.append(run_engine(model, reqs, args.batch, compiled=True))
            gen.append(run_generate(model, reqs, args.batch))
            if srv:
                vll.append(run_vllm(srv, reqs))
    finally:
        if srv:
            srv.stop()
    e, f, g = useful / min(eng), useful / min(hf), useful / min(gen)
    if vll:
        v = useful / min(vll)
        print(f"vLLM (HTTP)     : {v:8.0f} tokens/s")
    print(f"embedded engine : {e:8.0f} tokens/s")
    print(f"  HF forwards     : {f:8.0f} tokens/s (the engine calling the model, no lean forward)")
    if com:
        c = useful / min(com)
        print(f"  compiled        : {c:8.0f} tokens/s (compiled in {compile_s:.0f} s, before the timings)")
    print(f"model.generate  : {g:8.0f} tokens/s")
    print(f"ratio engine/generate: {e / g:.2f}x" + (f", vLLM/engine: {v / e:.2f}x" if vll else ""))
    line = {"engine_tokens_s": round(e), "generate_tokens_s": round(g), "engine_over_generate": round(e / g, 3),
            "engine_hf_tokens_s": round(f), "engine_hf_over_generate": round(f / g, 3), "lean_over_hf": round(e / f, 3)}
    if com:
        line.update(compiled_tokens_s=round(c), compiled_over_generate=round(c / g, 3),
                    compiled_over_engine=round(c / e, 3), compile_s=round(compile_s, 1))
    if vll:
        line.update(vllm_tokens_s=round(v), vllm_over_generate=round(v / g, 3), vllm_over_engine=round(v / e, 3))
    if not args.no_glm5:
        line.update(glm5(reqs, args.batch, args.repeats))
    print(json.dumps(line))


def glm5(reqs, batch: int, repeats: int) -> dict:
    """The embedded engine against `generate` on reverse-tiny's GLM-5 model, same requests; the engine
    calling the model instead of its lean forward; and the engine without its latent decode, on a copy
    of the weights the swap never touched (`generate` runs that copy: transformers' forward as it ships)."""
    import copy

    from prl.recipe.load import load_recipe

    cfg = load_recipe(Path(__file__).resolve().parents[1] / "recipes/reverse-tiny.toml").model
    model = build_model(write_model_dir(cfg, Path(tempfile.mkdtemp()) / "glm5")).eval()
    plain = copy.deepcopy(model)
    useful = sum(n for _, n in reqs)
    run_engine(model, reqs[:4], batch)
    run_engine(plain, reqs[:4], batch, latent=False)
    run_generate(plain, reqs[:4], batch)
    eng, hf, exp, gen = [], [], [], []
    for _ in range(repeats):
        eng.append(run_engine(model, reqs, batch))
        hf.append(run_engine(model, reqs, batch, lean=False))
        exp.append(run_engine(plain, reqs, batch, latent=False))
        gen.append(run_generate(plain, reqs, batch))
    e, f, x, g = useful / min(eng), useful / min(hf), useful / min(exp), useful / min(gen)
    print(f"GLM-5 (reverse-tiny's model): embedded engine {e:8.0f} tokens/s, calling the model {f:8.0f}, "
          f"without latent decode {x:8.0f}, model.generate {g:8.0f}: {e / g:.2f}x")
    return {"glm5_engine_tokens_s": round(e), "glm5_engine_hf_tokens_s": round(f), "glm5_expanded_engine_tokens_s": round(x),
            "glm5_generate_tokens_s": round(g), "glm5_engine_over_generate": round(e / g, 3),
            "glm5_lean_over_hf": round(e / f, 3), "glm5_latent_over_expanded": round(e / x, 3)}

if __name__ == "__main__":
    main()

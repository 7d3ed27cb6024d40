"""How long the garbage collector's full pass holds the GIL in an inference server, with and without the heap
freeze every prl process makes once started (`prl.system.freeze_heap`).

The process imports what the embedded engine's server imports (torch, transformers, fastapi), builds
reverse-tiny's GLM-5 model and an engine, and generates `--batches` batches of 128 completions (16 prompts x 8,
12 tokens), as a server does before its first full pass. Then, side by side: `gc.collect()` timed `--repeats`
times (median) as the heap stands, then after `freeze_heap()`. A full pass runs whenever enough new objects
have survived, in whichever thread allocates, and every other thread of the process waits for it; in a run of
reverse-tiny it came every 50 RL steps or so, and the engine's decode step it fell into took 0.15-0.2 s instead
of 0.01 (observed through the engine thread's schedstat: off the CPU and not waiting for one).

    .venv/bin/python bench/gc_pause.py [--batches 5] [--repeats 5]

The last line is one JSON object: `full_pass_ms` before and after, `before_over_after` (the after floored at
1 microsecond), `objects` tracked.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

import prl.inference.server  # noqa: F401 - the server's imports, as its process holds them
from prl.inference.engine import EngineCore, SamplingParams, Sequence
from prl.model.build import build_model
from prl.model.tiny import write_model_dir
from prl.recipe.load import load_recipe
from prl.system import freeze_heap

ROOT = Path(__file__).resolve().parents[1]


def generate(core: EngineCore, batches: int) -> None:
    rng = random.Random(0)
    for _ in range(batches):
        for _ in range(16):
            prompt = [rng.randrange(4, 40) for _ in range(rng.randint(8, 14))]
            for _ in range(8):
                core.add(Sequence(prompt, SamplingParams(temperature=1.0, max_tokens=12, stop_token_ids=(1,))))
        while core.has_work():
            core.step()


def full_pass_ms(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_recipe(ROOT / "recipes/reverse-tiny.toml").model
    model = build_model(write_model_dir(cfg, Path(tempfile.mkdtemp()) / "model")).eval()
    core = EngineCore(model, max_batch_size=128, prefix_cache_entries=256)
    generate(core, args.batches)
    objects = len(gc.get_objects())
    before = full_pass_ms(args.repeats)
    freeze_heap()
    after = full_pass_ms(args.repeats)
    gc.unfreeze()
    print(f"full pass over {objects} objects: {before:.1f} ms; after the freeze: {after:.4f} ms")
    print(json.dumps({"objects": objects, "full_pass_ms_before": round(before, 2),
                      "full_pass_ms_after": round(after, 4),
                      "before_over_after": round(before / max(after, 1e-3))}))  # after floored at 1 us


if __name__ == "__main__":
    main()

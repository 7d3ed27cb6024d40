"""Peak memory of the trainer's logprobs + backward for one long sequence: the chunked output head
(`prl.trainer.head`, what the trainer runs) against computing the full `[tokens, vocab]` logits.

Each variant runs in its own process (peak resident memory, `ru_maxrss`, is per process), on the
same hidden states, head weights and targets; the logprobs and gradients must agree. Prints a
table and, last, a JSON line.

    .venv/bin/python bench/logprob_memory.py [--tokens 8192] [--vocab 32768] [--hidden 256] [--chunk 1024]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one(tokens: int, vocab: int, hidden: int, chunk: int) -> dict:
    import torch

    from prl.trainer import head

    torch.manual_seed(0)
    torch.set_num_threads(2)
    lin = torch.nn.Linear(hidden, vocab, bias=False)
    head.install_on(lin)
    h = torch.randn(1, tokens, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    lin._prl_targets = (targets, 1.0, chunk)
    logp = lin(h)[0, :, 0]
    lin._prl_targets = None
    (-logp.sum()).backward()
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"chunk": chunk, "peak_mb": round((peak - base) / 1024, 1), "s": round(wall, 2),
            "logp_sum": float(logp.sum()), "grad_norm": float(h.grad.norm())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(one(a.tokens, a.vocab, a.hidden, a.one)))
        return
    rows = []
    for chunk in (0, a.chunk):
        cmd = [sys.executable, __file__, "--tokens", str(a.tokens), "--vocab", str(a.vocab), "--hidden", str(a.hidden),
               "--one", str(chunk)]
        rows.append(json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1]))
    full, chunked = rows
    logits_mb = a.tokens * a.vocab * 4 / 2**20
    print(f"{a.tokens} tokens, vocab {a.vocab}, hidden {a.hidden}: fp32 logits alone are {logits_mb:.0f} MB")
    for r in rows:
        name = 'full logits' if r['chunk'] == 0 else f"chunks of {r['chunk']}"
        print(f"  {name:>16}: "
              f"peak +{r['peak_mb']:.0f} MB, {r['s']:.2f} s")
    same = abs(full["logp_sum"] - chunked["logp_sum"]) <= 1e-4 * abs(full["logp_sum"]) and \
        abs(full["grad_norm"] - chunked["grad_norm"]) <= 1e-4 * full["grad_norm"]
    report = {"tokens": a.tokens, "vocab": a.vocab, "full_peak_mb": full["peak_mb"], "chunked_peak_mb": chunked["peak_mb"],
              "memory_ratio": round(full["peak_mb"] / max(chunked["peak_mb"], 1e-9), 1),
              "time_ratio": round(chunked["s"] / full["s"], 2), "same_result": same}
    print(json.dumps(report))


if __name__ == "__main__":
    main()

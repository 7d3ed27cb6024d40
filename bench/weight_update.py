"""One in-flight weight update, embedded engine against vLLM, for growing model sizes.

For each size a tiny Qwen3-MoE is saved as a Hugging Face folder and served by a real server of
each backend, started as `prl run` starts it; then versions are published as the trainer publishes
them (sealed folder; in-memory names for the embedded engine, checkpoint format for vLLM) and the
orchestrator's call `load_weights(v)` is timed:
- total: from the call to the server serving v (read, verify, load);
- stall: how long decoding stops. vLLM: pause (keep) to resume, as the backend measures it; its
  staging (fetch, verify, read) runs before the pause. Embedded engine: the copy into the model
  between two decode steps (`Policy.load_into`, timed in this process on the same tensors), since
  reading and verifying run off the engine thread.

    .venv/bin/python bench/weight_update.py [--hidden 128 384 768] [--updates 3]
"""

from __future__ import annotations

import argparse
import json
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from prl.backends.registry import make_backend  # noqa: E402
from prl.model.build import build_model  # noqa: E402
from prl.model.hf_format import to_checkpoint_format  # noqa: E402
from prl.model.tiny import char_tokenizer, write_model_dir  # noqa: E402
from prl.model.weights import version_dir, write_weights  # noqa: E402
from prl.recipe.schema import ModelCfg  # noqa: E402


def make_folder(root: Path, hidden: int):
    cfg = ModelCfg(arch="qwen3_moe", hidden_size=hidden, expert_dim=hidden, dense_dim=2 * hidden, num_layers=4)
    model = build_model(write_model_dir(cfg, root / "config"))
    model.save_pretrained(root / "hf")
    char_tokenizer().save_pretrained(root / "hf")
    return model, root / "hf"


def versions(model, n: int):
    for v in range(1, n + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
        yield v, {k: t.clone() for k, t in model.state_dict().items()}


async def timed_updates(srv, backend_kind: str, model, n: int, hf: bool) -> tuple[list[float], list[float]]:
    backend = make_backend(backend_kind, srv.url, srv.secret, eos_token_id=2)
    totals, stalls = [], []
    try:
        await backend.wait_ready(600)
        for v, state in versions(model, n):
            published = to_checkpoint_format(model, state) if hf else state
            write_weights(version_dir(srv.run_dir / "weights", v), published,
                          {"version": v, "format": "hf" if hf else "memory"})
            t0 = time.perf_counter()
            stall = await backend.load_weights(v)
            totals.append(time.perf_counter() - t0)
            stalls.append(stall if hf else copy_time(model, state))
    finally:
        await backend.close()
    return totals, stalls


def copy_time(model, state) -> float:
    from prl.inference.engine import Policy

    policy = Policy(state, {}, 0)
    t0 = time.perf_counter()
    policy.load_into(model)
    return time.perf_counter() - t0


def measure(hidden: int, n: int) -> dict:
    from vllm_rig import start_server

    root = Path(tempfile.mkdtemp())
    model, folder = make_folder(root, hidden)
    mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e6
    row = {"hidden": hidden, "MB": mb}
    for kind in ("embedded", "vllm"):
        srv = start_server(root / kind, folder, backend=kind)
        try:
            totals, stalls = asyncio.run(timed_updates(srv, kind, model, n, hf=kind == "vllm"))
        finally:
            srv.stop()
        row[kind] = (statistics.median(totals), statistics.median(stalls))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 384, 768])
    ap.add_argument("--updates", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"median of {args.updates} updates per cell; seconds")
    print(f"{'hidden':>6} {'weights MB':>10} | {'embedded total':>14} {'stall':>8} | {'vLLM total':>10} {'stall':>8}")
    line = {}
    for hidden in args.hidden:
        r = measure(hidden, args.updates)
        (et, es), (vt, vs) = r["embedded"], r["vllm"]
        print(f"{hidden:>6} {r['MB']:>10.1f} | {et:>14.3f} {es:>8.3f} | {vt:>10.3f} {vs:>8.3f}", flush=True)
        line.update({f"embedded_stall_s_h{hidden}": round(es, 4), f"vllm_stall_s_h{hidden}": round(vs, 4),
                     f"vllm_stall_over_embedded_h{hidden}": round(vs / max(es, 1e-9), 1)})
    print(json.dumps(line))


if __name__ == "__main__":
    main()

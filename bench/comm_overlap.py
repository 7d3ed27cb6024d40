"""The trainer's exchanges hidden behind its compute (`trainer.parallel.overlap`), over a shaped network.

On one machine loopback is a memcpy on the same cores, so nothing waits on a wire. Here every
trainer rank is its own host: a network namespace on a private bridge, each port shaped by tc's
token bucket to `--mbit` megabit/s each way (`tests/shaped_net.py`), so each all-to-all and gather
waits on the wire as between real hosts. Two layouts of a tiny GLM-5 MoE model (2 MoE layers, 8
experts of width 1024, top-4, one shared expert; the dense part is small, as in a large MoE, so
FSDP's own traffic stays small next to the experts'):

- EP 2: 2 hosts, one rank each;
- CP 2 x EP 2: 4 hosts, one rank each.

Each step trains 32 samples of 128 tokens (one micro-batch per data-parallel rank). The default link,
300 Mbit/s with jumbo frames (`--mtu`), puts the serial EP 2 step's exchanges at about 0.9 of its
compute, near the flagship plan's ratio of expert all-to-all and CP gathers (3.33 min) to compute
(4.07 min), 0.82; `--mbit` moves it.

Per layout one torchrun per host runs `tests/dist_overlap.py`: the same model and batch stepped with
overlap on and off, alternating, `--steps` each (the first of each left out: warm-up). Figures per
layout, medians over the steps:

- `step_s` overlapped and serial, and `overlap_over_serial`: the step time with overlap over without;
- `exchange_s`: the serial step's time in exchanges (`trainer_step.comm_s`: the experts' all-to-all
  and CP's gathers; all of it exposed when serial), `compute_s` the rest of the serial step, and
  `exchange_over_compute`; `forward_exchange_over_compute` the same for the forward alone;
- `exposed_s_overlap`, `exposed_s_forward`: the overlapped step's waits, all and in its forward;
- `overlap_efficiency`: the exchange time hidden, (serial - overlapped step) / min(compute, exchange);
- `clock_efficiency`: the same from the overlapped step's own clock, (comm_s - exposed_comm_s) /
  min(step - exposed, comm_s);
- `efficiency_ceiling`: the most that could be hidden, each pass (forward, backward) hiding the less of
  its exchanges and its compute, over min(compute, exchange); computed from the serial step's figures.

FSDP2's gathers and reductions cross the same links in both modes; on CPUs they block (FSDP2 overlaps
them through CUDA streams), and count as compute here. Needs root, `ip` and `tc`. The last line is one
JSON object: the figures per layout, and `overlap_efficiency` / `overlap_over_serial` headline (the lower
efficiency of the two layouts, and its step ratio).

    .venv/bin/python bench/comm_overlap.py [--mbit 300] [--mtu 9000] [--steps 5] [--chunks 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from shaped_net import ShapedLink, available, torchrun  # noqa: E402

from prl.model.tiny import write_model_dir  # noqa: E402
from prl.recipe.schema import ModelCfg  # noqa: E402

MODEL = ModelCfg(hidden_size=256, num_layers=2, first_dense_layers=0, num_heads=2, head_dim=32, num_experts=8,
                 experts_per_token=4, expert_dim=1024, index_topk=32, max_position_embeddings=512)
LAYOUTS = {"ep2": (2, {"ep": 2}), "cp2_ep2": (4, {"cp": 2, "ep": 2})}


def run_layout(model_dir: Path, out: Path, hosts: int, parallel: dict, args) -> dict:
    spec = {"cases": {"overlap": {"parallel": {**parallel, "overlap_chunks": args.chunks}, "micro_batch_tokens": 8192},
                      "serial": {"parallel": {**parallel, "overlap": False}, "micro_batch_tokens": 8192}},
            "steps": args.steps + 1, "samples": args.samples, "length": args.length}
    with (ShapedLink(hosts, args.mbit, args.mtu) as link,
          torchrun(link, ROOT / "tests" / "dist_overlap.py", [str(model_dir), str(out), json.dumps(spec)]) as procs):
        logs = [p.communicate(timeout=3600)[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"comm_overlap: a rank failed:\n{logs[0][-3000:]}")
    return figures(torch.load(out, weights_only=False))


def figures(r: dict) -> dict:
    keys = ("step_s", "comm_s", "exposed_comm_s", "forward_s", "forward_comm_s", "forward_exposed_s")
    med = {case: {k: statistics.median(v[k][1:]) for k in keys} for case, v in r.items()}
    o, s = med["overlap"], med["serial"]
    exchange, compute = s["comm_s"], s["step_s"] - s["comm_s"]
    fwd_x, fwd_c = s["forward_comm_s"], s["forward_s"] - s["forward_comm_s"]
    bwd_x, bwd_c = exchange - fwd_x, compute - fwd_c
    hidden_clock = o["comm_s"] - o["exposed_comm_s"]
    return {"step_s_overlap": round(o["step_s"], 3), "step_s_serial": round(s["step_s"], 3),
            "exchange_s": round(exchange, 3), "compute_s": round(compute, 3),
            "exchange_over_compute": round(exchange / compute, 3),
            "forward_exchange_over_compute": round(fwd_x / fwd_c, 3),
            "exposed_s_overlap": round(o["exposed_comm_s"], 3),
            "exposed_s_forward": round(o["forward_exposed_s"], 3),
            "overlap_over_serial": round(o["step_s"] / s["step_s"], 3),
            "overlap_efficiency": round((s["step_s"] - o["step_s"]) / min(compute, exchange), 3),
            "clock_efficiency": round(hidden_clock / min(o["step_s"] - o["exposed_comm_s"], o["comm_s"]), 3),
            # computed from the serial step: each pass hides at most the less of its exchanges and compute
            "efficiency_ceiling": round((min(fwd_x, fwd_c) + min(bwd_x, bwd_c)) / min(compute, exchange), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mbit", type=float, default=300, help="each host's link, megabit/s each way")
    ap.add_argument("--mtu", type=int, default=9000, help="the links' frame size, bytes")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per mode (after one warm-up)")
    ap.add_argument("--chunks", type=int, default=4, help="trainer.parallel.overlap_chunks")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--length", type=int, default=128, help="tokens per sample")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args()
    if why := available():
        sys.exit(f"comm_overlap: a shaped network {why}")
    out = {"mbit": args.mbit, "mtu": args.mtu, "chunks": args.chunks, "tokens_per_step": args.samples * args.length}
    with tempfile.TemporaryDirectory() as tmp:
        write_model_dir(MODEL, Path(tmp) / "model")
        for name in args.layouts.split(","):
            hosts, parallel = LAYOUTS[name]
            out[name] = run_layout(Path(tmp) / "model", Path(tmp) / f"{name}.pt", hosts, parallel, args)
            print(name, json.dumps(out[name]), flush=True)
    worst = min((out[n] for n in args.layouts.split(",")), key=lambda f: f["overlap_efficiency"])
    out["overlap_efficiency"], out["overlap_over_serial"] = worst["overlap_efficiency"], worst["overlap_over_serial"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()

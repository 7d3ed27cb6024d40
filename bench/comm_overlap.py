"""The trainer's exchanges hidden behind its compute (`trainer.parallel.overlap`), over a shaped network.

On one machine loopback is a memcpy on the same cores, so nothing waits on a wire. Here every
trainer rank is its own host: a network namespace on a private bridge, each port shaped by tc's
token bucket to `--mbit` megabit/s each way (`tests/shaped_net.py`), so each all-to-all and gather
waits on the wire as between real hosts. Two layouts of a tiny GLM-5 MoE model (2 MoE layers, 8
experts of width 1024, top-4, one shared expert; the dense part is small, as in a large MoE, so
FSDP's own traffic stays small next to the experts'):

- EP 2: 2 hosts, one rank each;
- CP 2 x EP 2: 4 hosts, one rank each.

Each step trains 32 samples of 128 tokens (one micro-batch per data-parallel rank). `--ratio R` sets each
layout's link so that its serial step's exchanges take R x its compute: a short serial run at `--mbit`
measures the ratio there, the link is set to `--mbit` x that / R (exchange time goes about as 1/bandwidth),
and again from there until a 4-step run lands within 0.05 of R (at most 4 runs). The measured run's own ratio,
which is reported, still moves by about 0.1 from its calibration's.
The flagship plan's ratio (`prl plan recipes/glm5-131k-28xh200.toml`: expert all-to-all and CP gathers over
the trainer's compute) is 0.82.

Per layout one torchrun per host runs `tests/dist_overlap.py`: the same model and batch stepped serial and in
each overlap mode (`--modes`: "chunks", the chunk pipeline inside each MoE layer, `trainer.parallel.overlap =
true`; "two_batch", each micro-batch as two halves, `prl.trainer.two_batch`; "two_batch_4", in four parts,
`overlap_parts = 4`; "two_batch_8", in eight), alternating, `--steps` each (the first of each left out:
warm-up). Figures per layout, medians over the steps; compute and exchanges are the serial step's forward
and backward (`fb_s`; the optimizer step and the barriers are left out):

- `exchange_s`: the serial step's time in exchanges (the experts' all-to-all and CP's gathers; all of it
  exposed when serial), `compute_s` the rest of its forward and backward, `exchange_over_compute` and
  `forward_exchange_over_compute` (the forward alone);
- per mode: `step_s`, `overlap_over_serial` (its step over the serial one), `exposed_s` and `exposed_s_forward`
  (its waits), `overlap_efficiency` (the exchange time hidden, (serial - overlapped forward and backward) /
  min(compute, exchange)) and `clock_efficiency` (the same from its own clock, (comm_s - exposed_comm_s) /
  min(fb - exposed, comm_s));
- `efficiency_ceiling`: the most that could be hidden, each pass (forward, backward) hiding the less of its
  exchanges and its compute, over min(compute, exchange); computed from the serial step's figures.

FSDP2's gathers and reductions cross the same links in every mode; on CPUs they block (FSDP2 overlaps them
through CUDA streams), and count as compute here. Needs root, `ip` and `tc`. The last line is one JSON object:
the figures per layout, and per mode `overlap_efficiency_<mode>` and `<mode>_over_serial`, the lower of the
two layouts (`overlap_efficiency` is the best mode's).

    .venv/bin/python bench/comm_overlap.py [--ratio 0.82] [--mbit 300] [--mtu 9000] [--steps 5] [--chunks 4]
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


MODES = {"serial": {"overlap": False}, "chunks": {"overlap": "chunks"},
         "two_batch": {"overlap": "two_batch", "overlap_parts": 2},
         "two_batch_4": {"overlap": "two_batch", "overlap_parts": 4},
         "two_batch_8": {"overlap": "two_batch", "overlap_parts": 8}}


def run_layout(model_dir: Path, out: Path, hosts: int, parallel: dict, mbit: float, modes: list[str], steps: int,
               args) -> dict:
    """The layout stepped in each of `modes` over links of `mbit`: what tests/dist_overlap.py saved."""
    cases = {m: {"parallel": {**parallel, **MODES[m], "overlap_chunks": args.chunks}, "micro_batch_tokens": 8192}
             for m in modes}
    spec = {"cases": cases, "steps": steps + 1, "samples": args.samples, "length": args.length}
    with (ShapedLink(hosts, mbit, args.mtu) as link,
          torchrun(link, ROOT / "tests" / "dist_overlap.py", [str(model_dir), str(out), json.dumps(spec)]) as procs):
        logs = [p.communicate(timeout=3600)[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"comm_overlap: a rank failed:\n{logs[0][-3000:]}")
    return torch.load(out, weights_only=False)


def medians(r: dict) -> dict:
    keys = ("step_s", "fb_s", "comm_s", "exposed_comm_s", "forward_s", "forward_comm_s", "forward_exposed_s")
    return {case: {k: statistics.median(v[k][1:]) for k in keys} for case, v in r.items()}


def serial_figures(s: dict) -> dict:
    exchange, compute = s["comm_s"], s["fb_s"] - s["comm_s"]
    fwd_x, fwd_c = s["forward_comm_s"], s["forward_s"] - s["forward_comm_s"]
    bwd_x, bwd_c = exchange - fwd_x, compute - fwd_c
    return {"step_s_serial": round(s["step_s"], 3), "exchange_s": round(exchange, 3), "compute_s": round(compute, 3),
            "exchange_over_compute": round(exchange / compute, 3),
            "forward_exchange_over_compute": round(fwd_x / fwd_c, 3),
            # each pass hides at most the less of its exchanges and its compute
            "efficiency_ceiling": round((min(fwd_x, fwd_c) + min(bwd_x, bwd_c)) / min(compute, exchange), 3)}


def figures(r: dict) -> dict:
    med = medians(r)
    s = med["serial"]
    out = serial_figures(s)
    hideable = min(s["fb_s"] - s["comm_s"], s["comm_s"])
    for mode, o in med.items():
        if mode == "serial":
            continue
        hidden_clock = o["comm_s"] - o["exposed_comm_s"]
        out[mode] = {"step_s": round(o["step_s"], 3), "overlap_over_serial": round(o["step_s"] / s["step_s"], 3),
                     "exposed_s": round(o["exposed_comm_s"], 3), "exposed_s_forward": round(o["forward_exposed_s"], 3),
                     "overlap_efficiency": round((s["fb_s"] - o["fb_s"]) / hideable, 3),
                     "clock_efficiency": round(hidden_clock / min(o["fb_s"] - o["exposed_comm_s"], o["comm_s"]), 3)}
    return out


CALIBRATE_TRIES, CALIBRATE_STEPS, CALIBRATE_WITHIN = 4, 4, 0.05


def link_for(model_dir: Path, out: Path, hosts: int, parallel: dict, args) -> float:
    """The link (megabit/s) at which the layout's serial exchanges take `args.ratio` x its compute: measured at
    `--mbit` and scaled, again from there until a run lands within CALIBRATE_WITHIN of the ratio (the ratio is
    not quite linear in the link, and a short run's is noisy), at most CALIBRATE_TRIES runs."""
    mbit = args.mbit
    for _ in range(CALIBRATE_TRIES if args.ratio else 0):
        run = run_layout(model_dir, out, hosts, parallel, mbit, ["serial"], CALIBRATE_STEPS, args)
        ratio = serial_figures(medians(run)["serial"])["exchange_over_compute"]
        print(f"calibrating: {mbit} Mbit/s gives exchanges / compute {ratio}", flush=True)
        if abs(ratio - args.ratio) <= CALIBRATE_WITHIN:
            break
        mbit = round(mbit * ratio / args.ratio, 1)
    return mbit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ratio", type=float, default=0.82, help="serial exchanges over compute to shape the links to "
                    "(0: the links at --mbit as they are)")
    ap.add_argument("--mbit", type=float, default=300, help="each host's link, megabit/s each way (before --ratio)")
    ap.add_argument("--mtu", type=int, default=9000, help="the links' frame size, bytes")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per mode (after one warm-up)")
    ap.add_argument("--chunks", type=int, default=4, help="trainer.parallel.overlap_chunks")
    ap.add_argument("--modes", default="chunks,two_batch,two_batch_4")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--length", type=int, default=128, help="tokens per sample")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args()
    if why := available():
        sys.exit(f"comm_overlap: a shaped network {why}")
    modes, layouts = args.modes.split(","), args.layouts.split(",")
    out = {"ratio": args.ratio, "mtu": args.mtu, "chunks": args.chunks, "tokens_per_step": args.samples * args.length}
    with tempfile.TemporaryDirectory() as tmp:
        write_model_dir(MODEL, Path(tmp) / "model")
        for name in layouts:
            hosts, parallel = LAYOUTS[name]
            mbit = link_for(Path(tmp) / "model", Path(tmp) / f"{name}.pt", hosts, parallel, args)
            run = run_layout(Path(tmp) / "model", Path(tmp) / f"{name}.pt", hosts, parallel, mbit,
                             ["serial", *modes], args.steps, args)
            out[name] = {"mbit": mbit, **figures(run)}
            print(name, json.dumps(out[name]), flush=True)
    for mode in modes:
        worst = min((out[n][mode] for n in layouts), key=lambda f: f["overlap_efficiency"])
        out[f"overlap_efficiency_{mode}"] = worst["overlap_efficiency"]
        out[f"{mode}_over_serial"] = worst["overlap_over_serial"]
    out["overlap_efficiency"] = max(out[f"overlap_efficiency_{m}"] for m in modes)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""R3: train/inference mismatch on a small GLM-5-architecture MoE, with and without routing replay.

Realistic numerics: both sides compute in bf16 from the same weights but run different kernels, as
in production. The engine decodes in batches with its KV cache (continuous batching, left-padded
rows) and captures the experts it routed every input token to; the trainer scores the same
completions as packed full sequences (what FSDP's bf16 mixed precision computes), once letting its
own router choose and once replaying the engine's experts. What remains with replay is dense-path
kernel numerics, which replay cannot touch; what replay removes is routing flips at near-ties.

Prints mismatch_kl (k3: mean exp(d)-d-1, d = logp_train - logp_infer) both ways and their ratio,
extreme_token_frac (|d| > ln 2) both ways, routing_agreement, the same against an fp32 trainer (the
older setting: there the mismatch is mostly bf16 rounding of the dense path, and the ratio near 1),
and the routing payload on the wire. `--table` adds layers x experts -> ratio, so a GLM-5 figure
(75 MoE layers, top-8 of 256) can be extrapolated from the trend rather than from one point.

    .venv/bin/python bench/r3_mismatch.py [--layers 4] [--experts 64] [--top-k 8] [--table]

Last line: the JSON report of the default (bf16 against bf16) configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import tempfile
import time
from pathlib import Path

import torch

from prl.inference.engine import EngineCore, SamplingParams, Sequence
from prl.inference.protocol import decode_routing, encode_routing
from prl.model.build import build_model, load_tokenizer
from prl.model.routing import Replay
from prl.model.tiny import EOS_ID, write_model_dir
from prl.envs import SingleTurnEnv
from prl.recipe.schema import ModelCfg, SamplingCfg, TaskCfg
from prl.tasks import make_task
from prl.trainer.loss import mismatch_stats, token_logprobs
from prl.trainer.trainer import sft_sample
from prl.transport.batch import MicroBatch, Sample, pack


def on(mb: MicroBatch, device) -> MicroBatch:
    return MicroBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(mb).items()})


def warm_start(model, tok, steps: int) -> None:
    """A short supervised start so routers and experts are trained, not random."""
    env = SingleTurnEnv(make_task(TaskCfg(), seed=1), tok, SamplingCfg(), 1, False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        samples = [sft_sample(env.demonstration(step * 32 + i)) for i in range(32)]
        for mb in pack(samples, 1, 4096)[0]:
            mb = on(mb, next(model.parameters()).device)
            out = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False)
            loss = -token_logprobs(out.logits[0], mb.target_ids)[mb.loss_mask].mean()
            loss.backward()
        opt.step()
        opt.zero_grad()


def rollouts(model, tok, prompts: int, group: int) -> tuple[list[Sample], list]:
    core = EngineCore(model, max_batch_size=256, capture_routing=True)
    task = make_task(TaskCfg(), seed=2)
    seqs = []
    for i in range(prompts):
        ids = tok(task.example(i)["prompt"]).input_ids
        for _ in range(group):
            seqs.append(Sequence(ids, SamplingParams(temperature=1.0, max_tokens=12, stop_token_ids=(EOS_ID,))))
            core.add(seqs[-1])
    while core.has_work():
        core.step()
    wires = [(encode_routing(s.prompt_routing), encode_routing(s.completion_routing())) for s in seqs]
    samples = [Sample(s.prompt_ids, s.out_ids, s.logprobs, s.versions, 0.0) for s in seqs]
    return samples, wires


def attach_routing(samples: list[Sample], wires) -> float:
    """What the orchestrator does per sample; returns seconds per sample."""
    t0 = time.perf_counter()
    for s, (p, c) in zip(samples, wires):
        s.routing = torch.cat([decode_routing(p), decode_routing(c)])
    return (time.perf_counter() - t0) / len(samples)


@torch.no_grad()
def mismatch(model, mbs, replay: Replay | None, use_ids: bool) -> dict:
    sums: dict[str, float] = {}
    agreed, total = 0.0, 0
    for mb in mbs:
        mb = on(mb, next(model.parameters()).device)
        ctx = replay.use(mb.routing) if replay and use_ids else contextlib.nullcontext()
        with ctx:
            out = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False)
        for k, v in mismatch_stats(token_logprobs(out.logits[0].float(), mb.target_ids), mb).items():
            sums[k] = sums.get(k, 0.0) + float(v)
        if replay:
            a, t = replay.agreement()
            agreed, total = agreed + a, total + t
    n = sums["loss_tokens"]
    return {"mismatch_kl": sums["mismatch_kl"] / n, "extreme_token_frac": sums["extreme_tokens"] / n,
            "routing_agreement": agreed / total if total else None, "tokens": int(n)}


def glm5_payload() -> dict:
    """A 131k-token GLM-5 rollout's routing (75 MoE layers, top-8 of 256): size and codec time."""
    ids = torch.randint(0, 256, (131072, 75, 8), dtype=torch.uint8)
    t0 = time.perf_counter()
    wire = encode_routing(ids)
    t1 = time.perf_counter()
    back = decode_routing(wire)
    t2 = time.perf_counter()
    assert torch.equal(back, ids)
    return {"glm5_131k_raw_MB": ids.numel() / 1e6, "glm5_131k_wire_MB": len(wire.data) / 1e6,
            "glm5_131k_encode_s": t1 - t0, "glm5_131k_decode_s": t2 - t1}


def measure(layers: int, experts: int, top_k: int, args) -> dict:
    """Warm-start a model of this shape, roll out with a bf16 engine, score with bf16 and fp32 trainers."""
    cfg = ModelCfg(num_layers=layers, num_experts=experts, experts_per_token=top_k)
    model_dir = write_model_dir(cfg, Path(tempfile.mkdtemp()) / "model")
    tok = load_tokenizer(model_dir)
    master = build_model(model_dir).to(args.device)
    warm_start(master, tok, args.warm_steps)
    master.eval()
    engine = copy.deepcopy(master).to(torch.bfloat16)
    samples, wires = rollouts(engine, tok, args.prompts, args.group)
    per_sample_s = attach_routing(samples, wires)
    mbs = pack(samples, 1, 4096)[0]
    out = {"per_sample_s": per_sample_s, "samples": samples, "wires": wires}
    for name, trainer in (("bf16", copy.deepcopy(master).to(torch.bfloat16)), ("fp32", master)):
        replay = Replay(trainer, replay=False)  # own routing, agreement still measured
        own = mismatch(trainer, mbs, replay, use_ids=True)
        replay.set_replay(True)
        out[name] = {"own": own, "replay": mismatch(trainer, mbs, replay, use_ids=True)}
    return out


def ratio(m: dict) -> float:
    return m["own"]["mismatch_kl"] / max(m["replay"]["mismatch_kl"], 1e-30)


def table(args) -> None:
    """Layers x experts -> ratio, top-k = min(8, experts / 2): bf16 trainer (the realistic setting)
    and fp32 trainer (where bf16 rounding of the engine perturbs near-tie routing)."""
    print(f"{'layers':>6} {'experts':>8} {'top-k':>6} | bf16 trainer: {'kl no replay':>12} {'kl replay':>10} "
          f"{'ratio':>6} {'agree':>8} | fp32 trainer: {'kl no replay':>12} {'kl replay':>10} {'ratio':>6} "
          f"{'agree':>8} {'|d|>ln2':>8}")
    for layers in (2, 4, 8):
        for experts in (16, 64):
            k = min(8, experts // 2)
            m = measure(layers, experts, k, args)
            cells = []
            for name in ("bf16", "fp32"):
                r = m[name]
                cells.append(f"{'':13} {r['own']['mismatch_kl']:>12.3e} {r['replay']['mismatch_kl']:>10.3e} "
                             f"{ratio(r):>6.2f} {r['own']['routing_agreement']:>8.3%}")
            print(f"{layers:>6} {experts:>8} {k:>6} | {cells[0]} | {cells[1]} "
                  f"{m['fp32']['own']['extreme_token_frac']:>8.1e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--warm-steps", type=int, default=80)
    ap.add_argument("--device", default="cpu", help="cuda: the engine and the trainer on the GPU (bin/gpu-check)")
    ap.add_argument("--table", action="store_true", help="also sweep layers x experts (several minutes)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.table:
        table(args)
    m = measure(args.layers, args.experts, args.top_k, args)
    samples, wires, bf16, fp32 = m["samples"], m["wires"], m["bf16"], m["fp32"]
    tokens = sum(s.num_tokens for s in samples)
    wire_bytes = sum(len(p.data) + len(c.data) for p, c in wires)
    raw_bytes = sum(s.routing.numel() * s.routing.element_size() for s in samples)
    report = {
        "model": f"glm_moe_dsa {args.layers} layers ({args.layers - 1} MoE), {args.experts} experts top-{args.top_k}, "
                 f"engine bf16 (batched decode, KV cache), trainer bf16 (packed sequences), {args.device}",
        "completion_tokens": bf16["own"]["tokens"],
        "mismatch_kl_no_replay": bf16["own"]["mismatch_kl"],
        "mismatch_kl_replay": bf16["replay"]["mismatch_kl"],
        "ratio": ratio(bf16),
        "extreme_token_frac_no_replay": bf16["own"]["extreme_token_frac"],
        "extreme_token_frac_replay": bf16["replay"]["extreme_token_frac"],
        "routing_agreement": bf16["own"]["routing_agreement"],
        "mismatch_kl_fp32_trainer_no_replay": fp32["own"]["mismatch_kl"],
        "mismatch_kl_fp32_trainer_replay": fp32["replay"]["mismatch_kl"],
        "ratio_fp32_trainer": ratio(fp32),
        "routing_agreement_fp32_trainer": fp32["own"]["routing_agreement"],
        "routing_bytes_per_token_raw": raw_bytes / tokens,
        "routing_bytes_per_token_wire": wire_bytes / tokens,
        "orchestrator_s_per_sample": m["per_sample_s"],
        **glm5_payload(),
    }
    for k, v in report.items():
        print(f"{k:36s} {v:.3e}" if isinstance(v, float) else f"{k:36s} {v}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()

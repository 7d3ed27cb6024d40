"""R3: train/inference mismatch on a small GLM-5-architecture MoE, with and without routing replay.

The inference engine runs in bf16 (as deployments do) and captures the experts it routed every
input token to; the trainer holds the fp32 master weights and recomputes the logprobs of the same
completions, once letting its own router choose and once replaying the engine's experts.

Prints mismatch_kl (k3: mean exp(d)-d-1, d = logp_train - logp_infer) both ways and their ratio,
extreme_token_frac (|d| > ln 2) both ways, routing_agreement, a bf16 trainer with replay (how much
of what remains is dense-path numerics), and the routing payload on the wire.

    .venv/bin/python bench/r3_mismatch.py [--experts 32] [--top-k 4] [--prompts 32] [--group 8]
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
from prl.recipe.schema import ModelCfg, TaskCfg
from prl.tasks import make_task
from prl.trainer.loss import mismatch_stats, token_logprobs
from prl.trainer.trainer import sft_sample
from prl.transport.batch import Sample, pack


def warm_start(model, tok, steps: int) -> None:
    """A short supervised start so routers and experts are trained, not random."""
    task = make_task(TaskCfg(), seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        exs = [task.example(step * 32 + i) for i in range(32)]
        samples = [sft_sample(tok, e) for e in exs]
        for mb in pack(samples, 1, 4096)[0]:
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--warm-steps", type=int, default=80)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = ModelCfg(num_layers=args.layers, num_experts=args.experts, experts_per_token=args.top_k)
    model_dir = write_model_dir(cfg, Path(tempfile.mkdtemp()) / "model")
    tok = load_tokenizer(model_dir)
    trainer = build_model(model_dir)
    warm_start(trainer, tok, args.warm_steps)
    trainer.eval()
    engine = copy.deepcopy(trainer).to(torch.bfloat16)
    samples, wires = rollouts(engine, tok, args.prompts, args.group)
    per_sample_s = attach_routing(samples, wires)
    mbs = pack(samples, 1, 4096)[0]
    replay = Replay(trainer, replay=False)  # own routing, agreement still measured
    own = mismatch(trainer, mbs, replay, use_ids=True)
    replay.set_replay(True)
    with_replay = mismatch(trainer, mbs, replay, use_ids=True)
    bf16 = copy.deepcopy(trainer).to(torch.bfloat16)
    bf16_watch = Replay(bf16, replay=False)
    bf16_own = mismatch(bf16, mbs, bf16_watch, use_ids=True)
    bf16_watch.set_replay(True)
    bf16_replay = mismatch(bf16, mbs, bf16_watch, use_ids=True)
    tokens = sum(s.num_tokens for s in samples)
    wire_bytes = sum(len(p.data) + len(c.data) for p, c in wires)
    raw_bytes = sum(s.routing.numel() * s.routing.element_size() for s in samples)
    report = {
        "model": f"glm_moe_dsa {args.layers} layers ({args.layers - 1} MoE), {args.experts} experts top-{args.top_k}, "
                 f"engine bf16, trainer fp32",
        "completion_tokens": own["tokens"],
        "mismatch_kl_no_replay": own["mismatch_kl"],
        "mismatch_kl_replay": with_replay["mismatch_kl"],
        "ratio": own["mismatch_kl"] / max(with_replay["mismatch_kl"], 1e-30),
        "extreme_token_frac_no_replay": own["extreme_token_frac"],
        "extreme_token_frac_replay": with_replay["extreme_token_frac"],
        "routing_agreement": own["routing_agreement"],
        "mismatch_kl_bf16_trainer_no_replay": bf16_own["mismatch_kl"],
        "mismatch_kl_bf16_trainer_replay": bf16_replay["mismatch_kl"],
        "routing_agreement_bf16_trainer": bf16_own["routing_agreement"],
        "routing_bytes_per_token_raw": raw_bytes / tokens,
        "routing_bytes_per_token_wire": wire_bytes / tokens,
        "orchestrator_s_per_sample": per_sample_s,
        **glm5_payload(),
    }
    for k, v in report.items():
        print(f"{k:34s} {v:.3e}" if isinstance(v, float) else f"{k:34s} {v}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()

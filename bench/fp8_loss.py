"""FP8 training against high precision on the same small GLM-5-architecture model, side by side.

The model's FP8-eligible dimensions are multiples of 128 (hidden 256, 4 heads of 64+64, experts
128, dense 512). Both runs start from the same init and see the same supervised batches of the
reverse task; the difference of the final smoothed loss is reported (DeepSeek-V3 reports under
0.25% against BF16). Then an FP8 engine generates rollouts and the trainer recomputes their
logprobs with and without FP8: `mismatch_kl` when both sides run FP8 against when only the
engine does.

    .venv/bin/python bench/fp8_loss.py [--steps 200] [--smooth 20]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from prl.inference.engine import EngineCore, SamplingParams, Sequence
from prl.model.fp8 import apply_fp8, backend
from prl.model.tiny import EOS_ID, char_tokenizer
from prl.recipe.schema import TaskCfg
from prl.tasks import make_task
from prl.trainer.loss import mismatch_stats, token_logprobs
from prl.trainer.trainer import sft_sample
from prl.transport.batch import Sample, pack


def make_model(vocab: int):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = GlmMoeDsaConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=1.0, kv_lora_rank=256,
        q_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, index_n_heads=2,
        index_head_dim=64, index_topk=256, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, pad_token_id=0, bos_token_id=1,
        eos_token_id=EOS_ID, tie_word_embeddings=False)
    torch.manual_seed(0)
    return GlmMoeDsaForCausalLM(cfg)


def batches(tok, steps: int, size: int = 32):
    task = make_task(TaskCfg(), seed=5)
    for step in range(steps):
        exs = [task.example(step * size + i) for i in range(size)]
        yield pack([sft_sample(tok, e) for e in exs], 1, 4096)[0][0]


def train(model, tok, steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for mb in batches(tok, steps):
        out = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False)
        loss = -token_logprobs(out.logits[0], mb.target_ids)[mb.loss_mask].mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def mismatch(engine, trainer, tok, prompts: int = 16, group: int = 4) -> float:
    core = EngineCore(engine, max_batch_size=128)
    task = make_task(TaskCfg(), seed=9)
    seqs = [Sequence(tok(task.example(i)["prompt"]).input_ids, SamplingParams(1.0, 1.0, 12, (EOS_ID,)))
            for i in range(prompts) for _ in range(group)]
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    [[mb]] = pack([Sample(s.prompt_ids, s.out_ids, s.logprobs, s.versions) for s in seqs], 1, 8192)
    out = trainer(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False)
    stats = mismatch_stats(token_logprobs(out.logits[0], mb.target_ids), mb)
    return float(stats["mismatch_kl"] / stats["loss_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--smooth", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = char_tokenizer()
    base = make_model(len(tok))
    fp8 = copy.deepcopy(base)
    report = apply_fp8(fp8)
    print(f"FP8 backend: {backend()}; {len(report['fp8'])} layers in FP8, kept in high precision: {report['kept']}")
    t0 = time.perf_counter()
    ref_losses = train(base, tok, args.steps)
    t1 = time.perf_counter()
    fp8_losses = train(fp8, tok, args.steps)
    t2 = time.perf_counter()
    ref, low = (sum(x[-args.smooth:]) / args.smooth for x in (ref_losses, fp8_losses))
    print(f"final loss (mean of last {args.smooth} of {args.steps} steps): fp32 {ref:.4f}  fp8 {low:.4f}  "
          f"relative difference {abs(low - ref) / ref:.3%}  (goal < 0.25%)")
    print(f"time: fp32 {t1 - t0:.0f}s, fp8 (CPU reference) {t2 - t1:.0f}s")
    base.eval()
    fp8.eval()
    engine = copy.deepcopy(base)
    apply_fp8(engine)
    both = mismatch(engine, copy.deepcopy(engine), tok)  # the trainer computes with the same FP8 recipe
    engine_only = mismatch(engine, base, tok)  # the trainer in fp32, the engine in FP8
    print(f"mismatch_kl trainer/engine: both FP8 {both:.3e}   engine-only FP8 {engine_only:.3e}")


if __name__ == "__main__":
    main()

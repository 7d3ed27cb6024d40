"""Run under torchrun by tests/test_parallel.py: one training step of the tiny model under a given
parallel layout: forward and backward, then the trainer's own optimizer step (finish the gradients,
clip by the global norm, AdamW). Rank 0 saves the loss, every full gradient (before clipping), the
gradient norm, every full weight after the step, and each loss token's logprob as the trainer
computed it next to the sample's own (the engine's, with `--samples`), gathered from every rank, and
each rank's logprob of every token it holds, per micro-batch (`rows`: [rank][micro-batch]).

    torchrun --nproc-per-node N tests/dist_step.py MODEL_DIR OUT.pt '{"parallel": {"ep": 2}, ...}' [--replay]
        [--samples SAMPLES.pt] [--cp-adapter] [--count] [--reference] [--lora]

`--reference`: a frozen reference policy (the tiny model at another seed, parallelized as the policy)
for trainer.loss.kl_coef. `--lora`: rank-4 adapters on the attention, dense MLP and shared experts (B drawn
from a fixed seed, so both A and B get gradients), the base frozen; with `--reference` the reference is the
base (the policy with its adapters off), as in a LoRA run.
"""

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from prl.model.build import build_model
from prl.model.families import routed_experts
from prl.model.routing import Replay, routers
from prl.model.policy import LoraPolicy, Reference
from prl.recipe.schema import LoraCfg, TrainerCfg
from prl.trainer import context_parallel
from prl.trainer.parallelize import Parallel
from prl.trainer.step import forward_backward
from prl.transport.batch import Sample, pack


def samples(layers: int, experts: int, k: int) -> list[Sample]:
    """Fixed samples (with replayed routing: k distinct experts per token and MoE layer)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        p = torch.randint(4, 40, (6 + i % 4,), generator=g).tolist()
        c = torch.randint(4, 40, (5 + i % 7,), generator=g).tolist()
        n = len(p) + len(c) - 1
        routing = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n * layers)]).view(n, layers, k)
        out.append(Sample(p, c, (-torch.rand(len(c), generator=g) * 3).tolist(), [0] * len(c),
                          float(i % 3) - 1.0, routing=routing.to(torch.uint8)))
    return out


def count_collectives(model) -> list[int]:
    """Collectives issued inside each attention module's forward (FSDP's gathers run before it, in
    the decoder layer's hooks): one entry per attention forward, in order."""
    counts: list[int] = []
    inside = []
    for name in ("all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor", "all_to_all_single",
                 "broadcast", "all_to_all"):
        original = getattr(dist, name)

        def counted(*a, _original=original, **k):
            if inside:
                counts[-1] += 1
            return _original(*a, **k)

        setattr(dist, name, counted)
    for m in model.modules():
        if type(m).__name__.endswith("GlmMoeDsaAttention"):
            def pre(mod, args, kwargs):
                if torch.is_grad_enabled() or not inside:
                    counts.append(0)
                    inside.append(1)

            def post(mod, args, kwargs, out):
                inside.clear()

            m.register_forward_pre_hook(pre, with_kwargs=True)
            m.register_forward_hook(post, with_kwargs=True)
    return counts


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def record_logprobs(seen: list, rows: list) -> None:
    """Each micro-batch's loss tokens as the trainer's loss receives them: [2, n] (the trainer's
    logprob, the sample's), on this rank (with cp, its part of the row); and in `rows` the logprob of
    every token this rank holds, in the order it holds them."""
    from prl.trainer import step as step_module

    loss = step_module.rl_loss

    def recording(logp, mb, cfg, *rest, **kw):
        seen.append(torch.stack([logp[mb.loss_mask], mb.infer_logprobs[mb.loss_mask]]).detach().float().cpu())
        rows.append(logp.detach().float().cpu())
        return loss(logp, mb, cfg, *rest, **kw)

    step_module.rl_loss = recording


class GradsWhenFinished:
    """The layout's `Parallel` as the trainer calls it, keeping every full gradient once finished
    (expert gradients reduced), before the norm clips them."""

    def __init__(self, par: Parallel):
        self.par, self.grads = par, None

    def finish_grads(self) -> None:
        self.par.finish_grads()
        self.grads = {n: full(p.grad).detach().clone() for n, p in self.par.model.named_parameters()
                      if p.grad is not None}

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.par.clip_grad_norm(max_norm)

    def __getattr__(self, name: str):  # anything else the trainer asks of its Parallel
        return getattr(self.par, name)


def optimizer_step(par: Parallel, tcfg: TrainerCfg) -> tuple[dict, float]:
    """One step of the trainer's own code (`Trainer.make_optimizer`, `Trainer.optimizer_step`): the
    finished gradients and the global gradient norm."""
    from prl.trainer.trainer import Trainer

    trainer = SimpleNamespace(par=GradsWhenFinished(par), model=par.model, tcfg=tcfg)
    opt, sched = Trainer.make_optimizer(trainer, tcfg.lr, 1)
    norm = Trainer.optimizer_step(trainer, opt, sched)
    return trainer.par.grads, norm


def stepped(par: Parallel, tcfg: TrainerCfg, stats: dict, before: dict) -> dict:
    """What `assert_same_step` compares, once the trainer's optimizer step ran: the step's stats, its finished
    gradients, the global norm, the weights after it and which moved (from `before`)."""
    grads, grad_norm = optimizer_step(par, tcfg)
    params = {n: full(p).detach().clone() for n, p in par.model.named_parameters()}
    return {"stats": stats, "grads": grads, "grad_norm": grad_norm, "params": params,
            "moved": sorted(n for n in params if not torch.equal(params[n], before[n]))}


def run_cases(one_step, model_dir: str, out: str, cases: dict) -> None:
    """`one_step(model_dir, case)` for every case in one gloo process group; rank 0 saves the results."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {name: one_step(model_dir, case) for name, case in cases.items()}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def with_adapters(model) -> None:
    from prl.model.lora import adapter_params, apply_lora

    apply_lora(model, model.config.model_type, 4, 8.0, 0.0, ["attention", "mlp", "shared_experts"], seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in adapter_params(model).items():
            if name.endswith("lora_B"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def main(model_dir: str, out: str, tcfg_json: str, replay: bool) -> None:  # noqa: C901
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tcfg = TrainerCfg.model_validate(json.loads(tcfg_json))
    model = build_model(model_dir, seed=0)
    if tcfg.fp8:
        from prl.model.fp8 import apply_fp8

        apply_fp8(model)
    if "--lora" in sys.argv:
        with_adapters(model)
    rp = Replay(model, replay=True) if replay else None
    cfg = model.config
    layers = len(routers(model))
    dims = tcfg.parallel.dims(dist.get_world_size()).build_meshes("cpu")
    par = Parallel(model, dims, tcfg)
    experts = routed_experts(cfg.to_dict())
    data = (torch.load(sys.argv[sys.argv.index("--samples") + 1], weights_only=False) if "--samples" in sys.argv
            else samples(layers, experts, cfg.num_experts_per_tok))  # --samples: the engine's (test_parallel)
    mbs = pack(data, dims.dp_size, 64)[dims.dp_rank(dist.get_rank())]
    seq = par.seq
    if seq is None and "--cp-adapter" in sys.argv:  # prl's DSA attention on one rank (no exchange)
        seq = context_parallel.install(par.model, None, 1, 0)
    counts = count_collectives(par.model) if "--count" in sys.argv else None
    seen: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    record_logprobs(seen, rows)
    before = {n: full(p).detach().clone() for n, p in par.model.named_parameters()}
    reference = None
    if "--reference" in sys.argv and "--lora" in sys.argv:  # the policy's model, adapters off, as a LoRA run's
        reference = LoraPolicy(LoraCfg(rank=4, alpha=8.0)).reference(par.model)
    elif "--reference" in sys.argv:
        reference = Reference(Parallel(build_model(model_dir, seed=1), dims, tcfg).model.requires_grad_(False))
    stats = forward_backward(par.model, rp, mbs, "rl", tcfg, 1.0, torch.device("cpu"), seq, reference=reference)
    if counts is not None:
        stats["collectives_per_attention_forward"] = counts
    grads, grad_norm = optimizer_step(par, tcfg)
    params = {n: full(p).detach().clone() for n, p in par.model.named_parameters()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, torch.cat(seen, dim=1) if seen else torch.zeros(2, 0))
    every_rows = [None] * dist.get_world_size()
    dist.all_gather_object(every_rows, rows)
    if dist.get_rank() == 0:
        torch.save({"stats": stats, "grads": grads, "grad_norm": grad_norm, "params": params,
                    "moved": sorted(n for n in params if not torch.equal(params[n], before[n])),
                    "logprobs": torch.cat(every, dim=1), "rows": every_rows}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], "--replay" in sys.argv[4:])

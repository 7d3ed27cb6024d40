"""The trainer: always under torchrun, FSDP2-sharded, SFT warm start then RL.

Rules:
- every RL step trains exactly the batch the orchestrator shipped for it, and publishes weights
  version step+1 (sealed, atomic) right after the optimizer step;
- the loss is normalised by the loss tokens of the whole step across all ranks;
- a checkpoint (model, optimizer, step, data position) is whole or absent.
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import torch
import torch.distributed as dist

from prl.metrics import EventLog
from prl.model.fp8 import apply_fp8
from prl.model.fp8 import backend as fp8_backend
from prl.model.fp8_checkpoint import tensor_names
from prl.model.routing import Replay, routers
from prl.recipe.resolve import ProcessConfig
from prl.tasks import make_task
from prl.trainer.checkpoint import load_checkpoint, publish, save_checkpoint
from prl.trainer.loss import rl_loss, sft_loss, token_logprobs
from prl.trainer.parallelize import make_mesh, parallelize
from prl.transport.batch import MicroBatch, Sample, pack
from prl.transport.endpoint import TrainerEndpoint

SFT_SEED_OFFSET = 7919  # warm-start prompts are drawn apart from the RL prompts


def lr_lambda(warmup: int, total: int, schedule: str, min_ratio: float):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "cosine":
            frac = min(1.0, (step - warmup) / max(1, total - warmup))
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        return 1.0

    return f


def sft_sample(tokenizer, example: dict) -> Sample:
    """A supervised sample: the prompt, then the answer and EOS as loss tokens."""
    prompt = tokenizer(example["prompt"]).input_ids
    answer = tokenizer(example["answer"]).input_ids + [tokenizer.eos_token_id]
    return Sample(prompt, answer, [0.0] * len(answer), [0] * len(answer), advantage=1.0)


class Trainer:
    def __init__(self, cfg: ProcessConfig):
        self.cfg, r = cfg, cfg.recipe
        self.tcfg, self.rl = r.trainer, r.rl
        self.run_dir = cfg.run_path
        self.temperature = r.sampling.temperature or 1.0
        self.log = EventLog(self.run_dir / "metrics.jsonl", "trainer")
        self.endpoint = None  # rank 0 only: rollouts in, weights out (prl.transport.endpoint)

    # ---- setup ----
    def setup(self) -> None:
        backend = self.tcfg.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.rank == 0:
            self.endpoint = TrainerEndpoint(self.run_dir, self.cfg.secret(), self.cfg.host, self.cfg.port).start()
        print(f"trainer: rank {self.rank} of {self.world} ({backend}, {self.device})", flush=True)
        torch.set_num_threads(self.tcfg.threads)
        from prl.model.build import build_model, load_tokenizer

        self.tokenizer = load_tokenizer(self.cfg.model_dir)
        model = build_model(self.cfg.model_dir, seed=self.cfg.recipe.run.seed).to(self.device)
        self.replay = Replay(model, replay=self.tcfg.router_replay) if routers(model) else None
        self.fp8_names = None
        if self.tcfg.fp8:
            report = apply_fp8(model)
            self.log_main("fp8", backend=fp8_backend(), fp8_layers=len(report["fp8"]), kept=report["kept"])
            if self.cfg.recipe.inference.fp8:  # the engine takes FP8 weights as published: half the bytes
                self.fp8_names = tensor_names(report["fp8"])
        self.model = parallelize(model, mesh=make_mesh(self.device))
        self.model.train()

    def make_optimizer(self, lr: float, total_steps: int):
        opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=self.tcfg.weight_decay)
        fn = lr_lambda(self.tcfg.warmup_steps, total_steps, self.tcfg.schedule, self.tcfg.min_lr_ratio)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, fn)

    def resume_schedule(self, step: int) -> None:
        """Continue the learning-rate schedule at `step` (the restored optimizer keeps its moments)."""
        self.scheduler.last_epoch = step
        for group, base, fn in zip(self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas):
            group["lr"] = base * fn(step)

    # ---- the loop ----
    def run(self) -> None:
        self.setup()
        self.optimizer, self.scheduler = self.make_optimizer(self.tcfg.lr, self.rl.max_steps)
        meta = load_checkpoint(self.model, self.optimizer, self.run_dir / "checkpoints")
        if meta is None:
            self.warm_start()
            self.optimizer, self.scheduler = self.make_optimizer(self.tcfg.lr, self.rl.max_steps)
            start, self.data_position = 0, 0
            self.checkpoint(0)
        else:
            start, self.data_position = meta["step"], meta["data_position"]
            self.resume_schedule(start)
            self.log_main("resumed", step=start, path=meta["path"])
        if self.endpoint:
            self.endpoint.resume = {"step": start, "data_position": self.data_position}
        self.publish(start)
        for step in range(start, self.rl.max_steps):
            self.rl_step(step)
            if step + 1 == self.rl.max_steps or (self.tcfg.checkpoint_every and (step + 1) % self.tcfg.checkpoint_every == 0):
                self.checkpoint(step + 1)
        dist.barrier()
        dist.destroy_process_group()
        if self.endpoint:
            self.endpoint.stop()

    def warm_start(self) -> None:
        sft = self.cfg.recipe.sft
        steps = sft.steps_for(self.cfg.recipe.model)
        if not steps:
            return
        opt, sched = self.make_optimizer(sft.lr, steps)
        task = make_task(self.cfg.recipe.task, self.cfg.recipe.run.seed + SFT_SEED_OFFSET)
        for step in range(steps):
            t0 = time.perf_counter()
            samples = [sft_sample(self.tokenizer, task.example(step * sft.batch_size + i)) for i in range(sft.batch_size)]
            mbs = pack(samples, self.world, self.tcfg.micro_batch_tokens)[self.rank]
            stats = self.forward_backward(mbs, kind="sft")
            stats["grad_norm"] = self.optimizer_step(opt, sched)
            stats["loss"] = stats.pop("loss_sum") / max(stats["loss_tokens"], 1)
            self.log_main("trainer_step", stage="sft", step=step, total=steps, fwd_bwd_s=time.perf_counter() - t0, **stats)

    def rl_step(self, step: int) -> None:
        t0 = time.perf_counter()
        mbs, data_position = self.receive(step)
        t1 = time.perf_counter()
        stats = self.forward_backward(mbs, kind="rl")
        stats["grad_norm"] = self.optimizer_step(self.optimizer, self.scheduler)
        t2 = time.perf_counter()
        self.publish(step + 1)
        t3 = time.perf_counter()
        self.data_position = data_position
        if self.endpoint:
            self.endpoint.inbox.discard_before(step)
        n = max(stats["loss_tokens"], 1)
        self.log_main(
            "trainer_step", stage="rl", step=step, total=self.rl.max_steps, loss=stats["loss_sum"] / n,
            mismatch_kl=stats["mismatch_kl"] / n, extreme_token_frac=stats["extreme_tokens"] / n,
            masked_frac=stats["masked_tokens"] / n, truncated_frac=stats["truncated_tokens"] / n,
            routing_agreement=stats["routing_agreed"] / stats["routing_ids"] if stats.get("routing_ids") else None,
            grad_norm=stats["grad_norm"], lr=self.scheduler.get_last_lr()[0], loss_tokens=stats["loss_tokens"],
            tokens=stats["tokens"], wait_s=t1 - t0, fwd_bwd_s=t2 - t1, publish_s=t3 - t2,
            tokens_per_s=stats["tokens"] / max(t2 - t1, 1e-9), version=step + 1,
        )

    def receive(self, step: int) -> tuple[list[MicroBatch], int]:
        """Rank 0 takes the step's batch from its inbox and scatters each rank its micro-batches
        (ranks on other hosts need no shared storage)."""
        parts = None
        if self.endpoint:
            batch = self.endpoint.inbox.receive(step)
            parts = [(mbs, batch.data_position) for mbs in batch.micro_batches]
            if len(parts) != self.world:
                raise RuntimeError(f"batch {step} is packed for {len(parts)} ranks, the trainer has {self.world}")
        out = [None]
        dist.scatter_object_list(out, parts, src=0)
        return out[0]

    # ---- numerics ----
    def forward_backward(self, mbs: list[MicroBatch], kind: str) -> dict[str, float]:
        """Accumulate gradients over this rank's micro-batches; returns stats summed over all ranks."""
        local_tokens = torch.tensor(float(sum(mb.loss_tokens for mb in mbs)), device=self.device)
        dist.all_reduce(local_tokens)
        scale = self.world / max(float(local_tokens), 1.0)  # FSDP averages gradients over ranks
        totals: dict[str, torch.Tensor] = {}
        for mb in mbs:
            mb = MicroBatch(**{k: None if v is None else v.to(self.device) for k, v in vars(mb).items()})
            with self.replay.use(mb.routing) if self.replay else contextlib.nullcontext():
                out = self.model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False)
            logp = token_logprobs(out.logits[0], mb.target_ids, self.temperature if kind == "rl" else 1.0)
            loss_sum, stats = rl_loss(logp, mb, self.tcfg.loss) if kind == "rl" else sft_loss(logp, mb)
            (loss_sum * scale).backward()
            stats["loss_sum"] = loss_sum.detach()
            stats["tokens"] = torch.tensor(float(mb.input_ids.numel()))
            if self.replay:
                stats["routing_agreed"], stats["routing_ids"] = map(torch.tensor, self.replay.agreement())
            for k, v in stats.items():
                totals[k] = totals.get(k, 0) + v.detach().float().to(self.device)
        keys = sorted(totals)
        packed = torch.stack([totals[k] for k in keys])
        dist.all_reduce(packed)
        return dict(zip(keys, packed.tolist()))

    def optimizer_step(self, opt, sched) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.max_grad_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return float(norm)

    # ---- outputs ----
    def publish(self, version: int) -> None:
        publish(self.model, self.run_dir / "weights", version, self.tcfg.keep_weights, self.fp8_names,
                hf_format=self.cfg.recipe.inference.backend == "vllm")

    def checkpoint(self, step: int) -> None:
        path = save_checkpoint(self.model, self.optimizer, self.run_dir / "checkpoints", step, self.data_position)
        if path:
            self.log_main("checkpoint", step=step, path=str(path))

    def log_main(self, kind: str, **fields) -> None:
        if self.rank == 0:
            self.log.emit(kind, **{k: round(v, 6) if isinstance(v, float) else v for k, v in fields.items()})


def main(config_path: str) -> None:
    import sys

    from prl.recipe.resolve import load_process_config

    Trainer(load_process_config(config_path)).run()
    # Everything is sealed and the process group destroyed: leave without the interpreter's teardown,
    # where a C++ thread of torch.distributed can abort a finished rank ("terminate called without an
    # active exception", SIGABRT; seen in 2 of 3 full suite runs after the last checkpoint was written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""The trainer: always under torchrun, FSDP2-sharded, SFT warm start then RL.

Rules:
- every RL step trains exactly the batch the orchestrator shipped for it, and publishes weights
  version step+1 (sealed, atomic) after the optimizer step: with `trainer.publish_overlap` from a frozen
  copy while the next step trains, one version at a time, in order;
- the loss is normalised by the loss tokens of the whole step across all ranks;
- a checkpoint (model, optimizer, step, data position) is whole or absent;
- batches stay in the inbox until a checkpoint covers them, so a trainer restarted after a fault
  replays the steps after its checkpoint from the same batches (`prl.trainer.ledger`).
"""

from __future__ import annotations

import json
import math
import os
import resource
import threading
import time

import torch
import torch.distributed as dist

from prl.metrics import EventLog, reporting_errors
from prl.usercode import blame
from prl.model.fp8 import backend as fp8_backend
from prl.model.fp8_checkpoint import tensor_names
from prl.recipe.roles import TrainerConfig
from prl.system import freeze_heap
from prl.envs import env_workload
from prl.envs.sft_data import warm_start_source
from prl.tasks import WARM_START_SEED_OFFSET
from prl.model.policy import BASE_CHECKPOINT, FULL, Reference, policy_for
from prl.model.weights import published_versions
from prl.trainer.checkpoint import load_checkpoint, save_checkpoint, sharded_format
from prl.trainer.publish import Background, parts_of, publish
from prl.trainer.ledger import read_ledger, record
from prl.trainer.loss import USER_FIGURE
from prl.trainer.model_setup import setup_model
from prl.trainer.overlap import CLOCK
from prl.trainer.step import forward_backward
from prl.transport.batch import MicroBatch, Sample, pack
from prl.transport.endpoint import TrainerEndpoint
from prl.transport.sinks import weight_sink


def lr_lambda(warmup: int, total: int, schedule: str, min_ratio: float):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "cosine":
            frac = min(1.0, (step - warmup) / max(1, total - warmup))
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        return 1.0

    return f


def sft_sample(demo) -> Sample:
    """A supervised sample from an environment's demonstration: its model tokens are the loss tokens
    (environment tokens, mask 0, are context only)."""
    n = len(demo.completion_ids)
    return Sample(demo.prompt_ids, demo.completion_ids, [0.0] * n, [0] * n, advantage=1.0, mask=demo.mask)


def warm_start_demos(source, start: int, count: int) -> tuple[list, int, list[str]]:
    """`count` demonstrations from index `start` on, past those the source skips (a row that cannot be one, a
    prompt longer than the task allows): (demonstrations, the next index, why each was skipped)."""
    from prl.envs import SkipExample

    demos, skipped, index = [], [], start
    while len(demos) < count:
        try:
            demos.append(source.demonstration(index))
        except SkipExample as e:
            skipped.append(str(e))
            if len(skipped) > max(1000, 10 * count):
                raise RuntimeError(f"sft: {len(skipped)} demonstrations skipped in a row, the last: {e}") from None
        except Exception as e:
            user = blame(e)  # the user's environment or dataset: their error, named, never restarted
            if user is None:
                raise
            raise user.on_example(index) from None
        index += 1
    return demos, index, skipped


def vocab_size(model_dir) -> int | None:
    import json

    return json.loads((model_dir / "config.json").read_text()).get("vocab_size")


class Trainer:
    def __init__(self, cfg: TrainerConfig, alone: bool = False):
        self.cfg, r = cfg, cfg
        self.alone = alone  # started by the driver as the only rank (`--alone`), not under torchrun
        self.tcfg, self.rl = r.trainer, r.rl
        self.run_dir = cfg.run_path
        self.temperature = r.sampling.temperature or 1.0
        self.log = EventLog(self.run_dir / "metrics.jsonl", "trainer")
        self.endpoint = None  # rank 0 only: rollouts in, weights out (prl.transport.endpoint)
        self.published_here = False  # a version published by this process (the first is written whole)
        self.read_ahead = ReadAhead()  # rank 0: the next step's batch, read while this one trains
        # what trains, and what a checkpoint and a weights version hold (LoRA: `prl.model.policy`)
        self.policy = policy_for(self.tcfg.lora)
        # trainer.loss.normalize = "constant": rl.batch_size x the longest completion the recipe allows
        self.norm_constant = r.rl.batch_size * env_workload(r.env, r.sampling).max_tokens

    # ---- setup ----
    def setup(self) -> None:
        backend = self.tcfg.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        if self.alone:  # one rank on one host, no torchrun: a group of one, its store in this process
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dims = self.tcfg.parallel.dims(self.world)  # the layout: rank arithmetic and meshes
        # trainer.publish_overlap: versions published on a thread, their shards on a group of their own (gloo:
        # the frozen copies sit in host memory)
        self.background = Background(self.device) if self.tcfg.publish_overlap else None
        self.publish_group = dist.new_group(backend="gloo") if self.background and self.world > 1 else None
        self.sink = self.make_sink()
        if self.rank == 0:
            self.endpoint = TrainerEndpoint(self.run_dir, self.cfg.secret(), self.cfg.host, self.cfg.port,
                                            world=self.dims.dp_size,
                                            vocab_size=vocab_size(self.cfg.model_dir), fallback=self.cfg.port_fallback,
                                            name="trainer", trees=self.tcfg.parallel.cp == 1,
                                            max_steps=self.rl.max_steps).start()
        print(f"trainer: rank {self.rank} of {self.world} ({backend}, {self.device})", flush=True)
        torch.set_num_threads(self.tcfg.threads)
        from prl.model.build import load_tokenizer

        self.tokenizer = load_tokenizer(self.cfg.model_dir)
        self.dims.build_meshes(self.device.type)
        built = self.build(on_base=self.policy.on_base and self.base_checkpoint() is not None)
        self.fp8_names = None
        if self.tcfg.fp8:
            self.log_main("fp8", backend=fp8_backend(), fp8_layers=len(built.fp8["fp8"]), kept=built.fp8["kept"])
            if self.cfg.publish_fp8:  # the engine takes FP8 weights as published: half the bytes
                self.fp8_names = tensor_names(built.fp8["fp8"])
        if built.bytes_read is not None:
            print(f"trainer: rank {self.rank} read {built.bytes_read / 2**20:.1f} MiB of its shards of "
                  f"{self.cfg.model_dir}", flush=True)

    def build(self, on_base: bool):
        """The model, parallelized; `on_base`: as the policy trains it (LoRA: adapters) on the step-0
        checkpoint's weights, else the model as the folder holds it (the warm start trains every weight)."""
        built = setup_model(self.cfg.model_dir, self.tcfg, self.dims, self.device, seed=self.cfg.run.seed,
                            policy=self.policy if on_base else FULL)
        self.par, self.model, self.replay = built.par, built.par.model, built.replay
        if on_base:
            from prl.trainer.checkpoint import load_model_state

            load_model_state(self.model, self.base_checkpoint())
        self.model.train()
        return built

    def base_checkpoint(self):
        """The step-0 checkpoint (the weights RL starts from, after the warm start), on every rank; None before
        it is written."""
        from prl.model.weights import sealed

        root = self.run_dir / "checkpoints"
        found = [0 in sealed(root, "step_") if self.rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        return root / BASE_CHECKPOINT if found[0] else None

    def make_sink(self):
        """Where the trainer publishes: the sealed folder (rank 0); with trainer.weight_transfer =
        "collective" also a stream into the servers from rank 0, with "stream" from every rank, each its
        share of the buckets (their addresses followed through RUN_DIR/ports on one machine)."""
        root, keep, path = self.run_dir / "weights", self.tcfg.keep_weights, self.tcfg.weight_transfer
        senders = self.world if path == "stream" else 1
        if path == "folder" or self.rank >= senders:
            return weight_sink("folder", root=root, keep=keep)
        import prl.transport.collective  # noqa: F401  (registers the sink)
        from prl.transport import ports

        cfg = self.cfg
        def servers() -> list[str]:
            if not cfg.port_fallback:
                return list(cfg.servers)
            return [ports.url_of(cfg.run_dir, f"inference-{i}", u) for i, u in enumerate(cfg.servers)]

        share, agree = (prl.transport.collective.over_the_trainer(self.device, self.publish_group) if senders > 1
                        else (None, None))
        return weight_sink("collective", root=root, keep=keep, servers=servers, secret=cfg.secret(), host=cfg.host,
                           timeout_s=self.tcfg.weight_transfer_timeout_s, device=self.device.type, rank=self.rank,
                           senders=senders, share=share, agree=agree)

    def make_optimizer(self, lr: float, total_steps: int):
        # fused: one kernel over all parameters (CPU and CUDA); reverse-tiny's step 24 -> 8.5 ms on CPU.
        # only what the policy trains (LoRA: the adapters) has requires_grad: the optimizer holds it alone
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=self.tcfg.weight_decay, fused=True)
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
        # under LoRA, step 0 is the base (no adapters, no optimizer): a run resumes from a later checkpoint
        meta = load_checkpoint(self.model, self.optimizer, self.run_dir / "checkpoints", after=self.policy.resume_after)
        if meta is None:
            start = self.begin()
        else:
            start, self.data_position, self.data_ahead = meta["step"], meta["data_position"], meta.get("data_ahead", [])
            self.resume_schedule(start)
            self.log_main("resumed", step=start, path=meta["path"])
        self.reference = self.make_reference()
        self.ledger = read_ledger(self.run_dir) if self.rank == 0 else {}
        if self.endpoint:
            self.endpoint.set_base(start, self.data_position, self.data_ahead)
        if not self.is_published(start):
            self.publish(start)
        freeze_heap()  # what setup and SFT made stays: no full collection pass over it mid-step
        for step in range(start, self.rl.max_steps):
            self.rl_step(step)
            if self.checkpoints_at(step + 1):
                self.checkpoint(step + 1)
            elif step + 1 in self.cfg.eval_points:  # an eval set scores these weights: `prl eval` can again
                self.checkpoint(step + 1, weights_only=True)
        if self.background:
            self.background.wait()  # the last version sealed (and sent) before the trainer ends
        dist.barrier()
        dist.destroy_process_group()
        if self.endpoint:
            if self.cfg.await_orchestrator:  # the final weights' evals are still running: serve until logged
                self.log_main("trainer", state="waiting for the final evals")
                self.endpoint.wait_finished()
            self.endpoint.stop()

    def begin(self) -> int:
        """A run with no checkpoint to resume: the warm start, then the step-0 checkpoint and a fresh optimizer.
        Under LoRA (`policy.on_base`) the step-0 checkpoint is the base, and the model is built again with adapters
        on it; a LoRA run restarted before its first adapter checkpoint finds its base written (and the model
        built on it)."""
        based = self.policy.on_base and self.base_checkpoint() is not None
        if not based:
            self.warm_start()
        self.data_position, self.data_ahead = 0, []
        if self.policy.on_base and not based:  # the base, no optimizer; the model is built again on it
            self.checkpoint(0)
            self.build(on_base=True)
        self.optimizer, self.scheduler = self.make_optimizer(self.tcfg.lr, self.rl.max_steps)
        if not self.policy.on_base:  # with the optimizer RL steps: saving it makes its state for every parameter,
            self.checkpoint(0)  # which a resumed run's strict load of a later checkpoint expects
        return 0

    def make_reference(self) -> Reference | None:
        """trainer.loss.kl_coef > 0: the policy RL starts from (the step-0 checkpoint, after the warm start),
        frozen and sharded as the policy (under LoRA the policy's own model, adapters off); None otherwise."""
        if not self.tcfg.loss.kl_coef:
            return None
        own = self.policy.reference(self.model)
        if own is not None:
            return own
        from prl.trainer.checkpoint import load_model_state
        from prl.trainer.model_setup import setup_reference

        ref = setup_reference(self.cfg.model_dir, self.tcfg, self.dims, self.device, seed=self.cfg.run.seed)
        path = self.run_dir / "checkpoints" / BASE_CHECKPOINT
        load_model_state(ref, path)
        self.log_main("reference", state="loaded", path=str(path))
        return Reference(ref)

    def checkpoints_at(self, version: int) -> bool:
        """The last step and every trainer.checkpoint_every."""
        every = self.tcfg.checkpoint_every
        return version == self.rl.max_steps or bool(every and version % every == 0)

    def warm_start(self) -> None:
        sft = self.cfg.sft
        steps = sft.steps_for(self.cfg.model)
        if not steps:
            return
        opt, sched = self.make_optimizer(sft.lr, steps)
        cfg = self.cfg
        demos_from = warm_start_source(cfg.env, cfg.task, cfg.sft, cfg.run.seed + WARM_START_SEED_OFFSET,
                                       self.tokenizer, cfg.sampling)
        index, skipped = 0, 0
        for step in range(steps):
            t0 = time.perf_counter()
            demos, index, why = warm_start_demos(demos_from, index, sft.batch_size)
            if why and not skipped:
                self.log_main("example_skipped", stage="sft", why=why[0], total=len(why))
            skipped += len(why)
            if step == 0:
                self.check_turn_lengths(demos)
            samples = [sft_sample(d) for d in demos]
            mbs = pack(samples, self.dims.dp_size, self.tcfg.micro_batch_tokens)[self.dims.dp_rank(self.rank)]
            stats = self.forward_backward(mbs, kind="sft")
            stats["grad_norm"] = self.optimizer_step(opt, sched)
            stats["loss"] = stats.pop("loss_sum") / max(stats["loss_tokens"], 1)
            self.log_main("trainer_step", stage="sft", step=step, total=steps, fwd_bwd_s=time.perf_counter() - t0,
                          skipped_examples=skipped, **stats)

    def check_turn_lengths(self, demos) -> None:
        """Say when demonstrations teach turns longer than `sampling.max_tokens`: sampling cuts such a
        turn (a tool call loses its argument's end), so RL starts from what the warm start did not teach."""
        cap = self.cfg.sampling.max_tokens
        over = [d for d in demos if max(model_turn_lengths(d.mask or [1] * len(d.completion_ids)), default=0) > cap]
        if over:
            self.log_main("error", name="trainer", line=f"sft: {len(over)} of {len(demos)} demonstrations have a model "
                          f"turn longer than sampling.max_tokens = {cap}; sampling cuts such turns: raise it")

    def rl_step(self, step: int) -> None:
        """Train `step`; after a restart, a step the ledger holds is replayed (same batch): its weights version
        was published before the fault (republished only where it was never sealed), and it is not recorded."""
        t0 = time.perf_counter()
        mbs, (data_position, data_ahead), prompts, replayed = self.receive(step)
        t1 = time.perf_counter()
        stats = self.forward_backward(mbs, kind="rl")
        stats["grad_norm"] = self.optimizer_step(self.optimizer, self.scheduler)
        t2 = time.perf_counter()
        # a replayed step's version was sealed before the fault, unless the fault came while it was published in
        # the background (the ledger records a step once its version is handed over): then it is published now
        publish_wait = 0.0 if self.is_published(step + 1) else self.publish(step + 1)
        t3 = time.perf_counter()
        self.data_position, self.data_ahead = data_position, data_ahead
        if self.rank == 0 and not replayed:
            record(self.run_dir, step, prompts)
            self.ledger[step] = prompts
        n = max(stats["loss_tokens"], 1)
        self.log_main(
            "trainer_step", stage="rl", step=step, total=self.rl.max_steps, loss=stats["loss_sum"] / stats["loss_divisor"],
            entropy=stats["entropy"] / n, kl_ref=stats["kl_ref"] / n if "kl_ref" in stats else None,
            kl_teacher=stats["kl_teacher"] / n if "kl_teacher" in stats else None,
            mismatch_kl=stats["mismatch_kl"] / n, extreme_token_frac=stats["extreme_tokens"] / n,
            masked_frac=stats["masked_tokens"] / n, truncated_frac=stats["truncated_tokens"] / n,
            routing_agreement=stats["routing_agreed"] / stats["routing_ids"] if stats.get("routing_ids") else None,
            grad_norm=stats["grad_norm"], lr=self.scheduler.get_last_lr()[0], loss_tokens=stats["loss_tokens"],
            tokens=stats["tokens"], wait_s=t1 - t0, fwd_bwd_s=t2 - t1, publish_s=t3 - t2, publish_wait_s=publish_wait,
            comm_s=stats["comm_s"], exposed_comm_s=stats["exposed_comm_s"],
            tokens_per_s=stats["tokens"] / max(t2 - t1, 1e-9), version=step + 1, replayed=replayed,
            peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            **{k: v for k, v in stats.items() if k.startswith(USER_FIGURE)},
        )

    def receive(self, step: int) -> tuple[list[MicroBatch], tuple[int, list[int]], list[int], bool]:
        """Rank 0 takes the step's batch from its inbox (read ahead, while the step before trained: `ReadAhead`)
        and scatters each rank the micro-batches of its data-parallel rank (CP peers get the same ones and each
        computes its slice; ranks on other hosts need no shared storage), with whether the step is a replay."""
        parts = None
        if self.endpoint:
            batch = self.read_ahead.take(step, self.endpoint.inbox.receive)
            if step + 1 < self.rl.max_steps:  # the next batch read while this step trains
                self.read_ahead.start(step + 1, self.endpoint.inbox.receive)
            replayed = step in self.ledger
            if len(batch.micro_batches) != self.dims.dp_size:
                raise RuntimeError(f"batch {step} is packed for {len(batch.micro_batches)} ranks, the trainer has "
                                   f"{self.dims.dp_size} data-parallel ranks")
            parts = [(batch.micro_batches[self.dims.dp_rank(r)], (batch.data_position, batch.data_ahead),
                      batch.prompt_indices, replayed)
                     for r in range(self.world)]
        out = [None]
        dist.scatter_object_list(out, parts, src=0)
        return out[0]

    # ---- numerics ----
    def forward_backward(self, mbs: list[MicroBatch], kind: str) -> dict[str, float]:
        """The step's forward and backward; its stats gain this rank's seconds of exchanges in flight
        (`comm_s`) and waited for (`exposed_comm_s`, `prl.trainer.overlap`); None on NCCL, whose waits
        hold the stream, not the host (the host's clock cannot see them)."""
        temperature = self.temperature if kind == "rl" else 1.0
        CLOCK.reset()
        stats = forward_backward(self.model, self.replay, mbs, kind, self.tcfg, temperature, self.device, self.par.seq,
                                 norm_constant=self.norm_constant, reference=self.reference if kind == "rl" else None,
                                 teacher_kl=(self.cfg.teacher_kl_coef, self.cfg.teacher_kl_estimator))
        host_waits = dist.get_backend() == "gloo"
        stats["comm_s"], stats["exposed_comm_s"] = CLOCK.figures() if host_waits else (None, None)
        return stats

    def optimizer_step(self, opt, sched) -> float:
        self.par.finish_grads()
        norm = self.par.clip_grad_norm(self.tcfg.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return float(norm)

    # ---- outputs ----
    def is_published(self, version: int) -> bool:
        """Whether rank 0 holds sealed weights `version` or newer (published before a restart: an
        older version pruned since is not brought back); every rank gets rank 0's answer, since
        publishing is a collective."""
        versions = published_versions(self.run_dir / "weights") if self.rank == 0 else []
        found = [bool(versions) and versions[-1] >= version] if self.rank == 0 else [None]
        dist.broadcast_object_list(found, src=0)
        return bool(found[0])

    def publish(self, version: int) -> float:
        """Weights `version`, as the policy says it is held (under LoRA version 0 is the base, whole, and every
        later one the adapters alone: the base is published again first where its folder is gone). With
        trainer.publish_overlap it goes on in the background from a frozen copy (`publish.Background`); returns
        the seconds the step waited for the version before it."""
        form, hf_format = self.policy.version(version), self.cfg.publish_format == "hf"
        if form.adapters and not self.base_published(form.base):
            if self.background:
                self.background.wait()
            publish(self.model, weight_sink("folder", root=self.run_dir / "weights", keep=self.tcfg.keep_weights),
                    form.base, hf_format=hf_format)
        whole = self.whole_version(version)
        self.published_here = True
        if self.background is None:
            self.send(version, form, hf_format, whole)
            return 0.0
        t = time.perf_counter()
        self.background.wait()  # before the copy: one frozen copy in host memory at a time
        waited = time.perf_counter() - t
        parts = parts_of(self.model, form, frozen=True)
        self.background.submit(lambda: self.send(version, form, hf_format, whole, parts))
        return waited

    def send(self, version: int, form, hf_format: bool, whole: bool, parts=None) -> None:
        """Publish `version` (from `parts`, frozen, over the publish group; else the weights as they are) and say so."""
        publish(self.model, self.sink, version, self.fp8_names, hf_format=hf_format, whole=whole, form=form,
                parts=parts, group=self.publish_group if parts is not None else None)
        if self.endpoint:
            self.endpoint.sealed()  # wakes the orchestrator's long poll for new weights
        sent = getattr(self.sink, "last", None)  # the collective's delivery of this version
        if sent is not None:
            self.log_main("weights_sent", version=version, servers=sent.servers, bytes=sent.bytes,
                          send_s=sent.send_s, error=sent.error, backend=sent.backend, senders=sent.senders)

    def base_published(self, version: int) -> bool:
        """Whether `version`, the base of adapter versions, is sealed whole in RUN_DIR/weights (on every rank)."""
        from prl.model.weights import MANIFEST, version_dir

        base = version_dir(self.run_dir / "weights", version) / MANIFEST
        found = [base.is_file() and not json.loads(base.read_text()).get("streamed_only") if self.rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        return bool(found[0])

    def whole_version(self, version: int) -> bool:
        """Whether the sealed folder of `version` must hold its tensors. Only the stream from every rank
        leaves them out, except in the first version this process publishes and each checkpoint's
        version (what a restarted trainer continues from); a server that missed the stream gets the
        version whole anyway (`publish`)."""
        return self.tcfg.weight_transfer != "stream" or not self.published_here or self.checkpoints_at(version)

    def checkpoint(self, step: int, weights_only: bool = False) -> None:
        """A resumable checkpoint; `weights_only`: the model's weights alone (what `prl eval` reads)."""
        # step 0 under LoRA: the base, before adapters (no optimizer); later ones the adapters and their optimizer
        optimizer = self.optimizer if self.policy.checkpoint_optimizer(step) and not weights_only else None
        path = save_checkpoint(self.model, optimizer,
                               self.run_dir / "checkpoints", step, self.data_position, data_ahead=self.data_ahead,
                               sharded=sharded_format(self.tcfg.checkpoint_format,
                                                      shared=bool(self.cfg.shared_checkpoints)),
                               snapshot=weights_only,
                               extra=self.policy.checkpoint_manifest(step))
        if path:  # a weights-only snapshot is not a checkpoint a run resumes from: an event of its own
            self.log_main("eval_weights" if weights_only else "checkpoint", step=step, path=str(path))
        if weights_only:
            return
        if self.endpoint:  # batches before a checkpoint are never replayed: drop them (base first: /resume
            self.endpoint.set_base(step, self.data_position, self.data_ahead)  # never walks from a base whose files are gone)
            self.endpoint.inbox.discard_before(step)

    def log_main(self, kind: str, **fields) -> None:
        if self.rank == 0:
            self.log.emit(kind, **{k: round(v, 6) if isinstance(v, float) else v for k, v in fields.items()})


class ReadAhead:
    """The next step's batch read from the inbox on a thread of its own (waiting for it to land, then loading it)
    while the trainer computes this step: the step after takes it at once when the orchestrator shipped it in
    time. A daemon thread: a trainer that ends or fails does not wait for a batch that never comes."""

    def __init__(self):
        self.step: int | None = None
        self.thread: threading.Thread | None = None
        self.got: list = []

    def start(self, step: int, read) -> None:
        self.step, self.got = step, []

        def run(got=self.got) -> None:
            try:
                got.append(read(step))
            except BaseException as e:  # noqa: BLE001 - read again (and raised) by `take` in the trainer's thread
                got.append(e)

        self.thread = threading.Thread(target=run, name="prl-read-ahead", daemon=True)
        self.thread.start()

    def take(self, step: int, read):
        """The batch of `step`: the one read ahead if it is that step's (waiting for it), else read now."""
        if self.step != step or self.thread is None:
            return read(step)
        self.thread.join()
        got, self.thread, self.step = self.got[0], None, None
        return read(step) if isinstance(got, BaseException) else got


def main(config_path: str, alone: bool = False) -> None:
    import sys

    from prl.recipe.resolve import load_process_config

    cfg = load_process_config(config_path)
    name = f"{cfg.name} rank {os.environ.get('RANK', '0')}"
    with reporting_errors(EventLog(cfg.run_path / "metrics.jsonl", "trainer"), name):
        Trainer(cfg, alone).run()
    # Everything is sealed and the process group destroyed: leave without the interpreter's teardown,
    # where a C++ thread of torch.distributed can abort a finished rank ("terminate called without an
    # active exception", SIGABRT; seen in 2 of 3 full suite runs after the last checkpoint was written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def model_turn_lengths(mask: list[int]) -> list[int]:
    """Lengths of the runs of model tokens (mask 1) of a completion."""
    runs, n = [], 0
    for m in [*mask, 0]:
        if m:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs

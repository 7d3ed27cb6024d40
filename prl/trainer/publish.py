"""Publishing policy weights vN for the inference servers, bucket by bucket.

The model's state is walked one decoder layer at a time (then what is left: embeddings, final norm,
output head): each sharded tensor of the bucket is sent to rank 0 shard by shard by the other ranks
of rank 0's shard group (point to point; replicas elsewhere send nothing; no rank but 0 holds the
whole tensor, as `DTensor.full_tensor` would on every rank), and rank 0 converts the bucket
(Hugging Face names and layouts for vLLM, block-FP8 where the engine runs FP8), hands it to the
weight sink (`prl.transport.sinks`; the sealed folder writes it as one safetensors file) and frees
it before the next. No rank ever holds more than one layer of the full model. The sink seals the
version whole (the folder: manifest last, renamed in).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from prl.model.policy import WHOLE, Version
from prl.parallel_dims import ShardLayout, shard_layout
from prl.transport.sinks import WeightSink

LAYER = re.compile(r"\blayers\.(\d+)\.")


def buckets(names: list[str]) -> list[list[str]]:
    """Names grouped by decoder layer, in layer order, then the rest (kept in their order)."""
    layers: dict[int, list[str]] = {}
    rest = []
    for name in names:
        m = LAYER.search(name)
        (layers.setdefault(int(m.group(1)), []) if m else rest).append(name)
    return [layers[i] for i in sorted(layers)] + ([rest] if rest else [])


@dataclass
class Part:
    """This rank's part of one published tensor: its local shard (or the whole tensor), how the tensor is sharded
    (None: whole on every rank) and its whole shape. `frozen` parts are copies the next optimizer step cannot
    change (a background publish sends them while the trainer goes on)."""

    local: torch.Tensor
    layout: ShardLayout | None
    shape: torch.Size
    frozen: bool = False

    @staticmethod
    def of(tensor: torch.Tensor, frozen: bool = False) -> "Part":
        layout = shard_layout(tensor)
        local = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()
        if frozen:  # into host memory: the device keeps no second copy of the weights
            local = local.to("cpu", copy=True)
        return Part(local, layout, tensor.shape, frozen)


def parts_of(model, form: Version, frozen: bool = False) -> dict[str, Part]:
    """This rank's part of every tensor `form` publishes, copied where `frozen`."""
    return {k: Part.of(v, frozen) for k, v in get_model_state_dict(model).items() if form.holds(k)}


def gathered(part: Part, dst: int, group=None) -> torch.Tensor | None:
    """The whole tensor on rank `dst` (in CPU memory), None elsewhere. A sharded one is sent to `dst`
    shard by shard by the other ranks of `dst`'s shard group (replicas elsewhere send nothing): no
    rank but `dst` ever holds the whole tensor, and `dst` holds one shard at a time on its device."""
    if part.layout is not None:
        return gather_rows(part, dst, group)
    if dist.get_rank() != dst:
        return None
    return part.local if part.frozen else part.local.to("cpu", copy=True)


def gather_rows(part: Part, dst: int, group=None) -> torch.Tensor | None:
    """`gathered` for a sharded tensor, along whichever dim its layout names: the shards of `dst`'s group,
    in shard order, each sent padded to `per` (torch.chunk's size) and trimmed there. `group`: the process
    group the shards travel on (global ranks; None: the default group)."""
    layout = part.layout
    if dst not in layout.ranks:
        return None  # a replica of shards `dst`'s group already has
    local, d = part.local, layout.tensor_dim
    padded_shape = (*part.shape[:d], layout.per, *part.shape[d + 1:])
    if dist.get_rank() != dst:
        padded = local.new_zeros(padded_shape)
        padded.narrow(d, 0, local.shape[d]).copy_(local)
        dist.send(padded, dst=dst, group=group)
        return None
    full = torch.empty(part.shape, dtype=local.dtype)
    buf = local.new_empty(padded_shape)
    for k, src in enumerate(layout.ranks):
        start, stop = layout.bounds(k)
        if src == dst:
            chunk = local
        else:
            dist.recv(buf, src=src, group=group)
            chunk = buf.narrow(d, 0, stop - start)
        full.narrow(d, start, stop - start).copy_(chunk.cpu())
    return full


def converted(model, part: dict[str, torch.Tensor], hf_format: bool, fp8_names: list[str] | None) -> dict:
    """One bucket as the servers take it: checkpoint names (`hf_format`) or in-memory ones, its FP8
    tensors block-quantised (in checkpoint names: each expert's own weight and scales)."""
    names = [n for n in fp8_names or [] if n in part]
    if hf_format and names:
        from prl.model.fp8_checkpoint import to_fp8_checkpoint

        return to_fp8_checkpoint(model, part, names)
    if hf_format:
        from prl.model.hf_format import to_checkpoint_format

        return to_checkpoint_format(model, part)
    if names:
        from prl.model.fp8_checkpoint import quantize_state_dict

        part = quantize_state_dict(part, names)
    return part


def publish(model, sink: WeightSink, version: int, fp8_names: list[str] | None = None,
            hf_format: bool = False, whole: bool = True, form: Version = WHOLE, parts: dict[str, Part] | None = None,
            group=None) -> Path | None:
    """Publish weights vN into `sink` (every rank calls; rank 0 returns where the version is).
    `hf_format`: Hugging Face checkpoint names (what vLLM's `load_weights` reads), else the model's
    in-memory names (what the embedded engine copies in). `fp8_names`: published block-FP8; one in no
    bucket fails the version before it is sealed. `parts`: what to send (`parts_of`; None: the model's
    weights as they are now); `group`: the process group the shards travel on (None: the default).

    A sink fed by several ranks (`sink.senders`: the collective stream) takes bucket b from rank
    b % senders, its owner, which streams it. Rank 0 also gathers every other bucket for the sealed
    folder, unless not `whole`: then it seals an empty folder once every server staged the version,
    and when one did not, every rank publishes the version again, whole, into the folder.

    `form`: what the version holds (`prl.model.policy.Version`): every weight (of a model with LoRA adapters,
    every weight but them), or the LoRA adapters alone, which the servers merge into the base version's weights;
    the manifest says so."""
    state = parts_of(model, form) if parts is None else parts  # this rank's shards
    rank, senders = dist.get_rank(), getattr(sink, "senders", 1)
    whole = whole or senders == 1
    if rank < senders:
        sink.begin(version, whole)
    unmatched = set(fp8_names or [])
    for b, names in enumerate(buckets(list(state))):
        owner = b % senders
        part = {name: gathered(state[name], owner, group) for name in names}
        if owner != 0 and whole:  # the folder's copy, on rank 0
            folder = {name: gathered(state[name], 0, group) for name in names}
        convert = (lambda p: form.wire(model, p, hf_format)) if form.adapters else \
            (lambda p: converted(model, p, hf_format, fp8_names))
        if rank == owner:
            sink.put(convert(part))
        elif rank == 0 and whole:
            sink.put(convert(folder), stream=False)
        if rank == 0 and (whole or owner == 0):
            unmatched -= set(names)  # converted() fails on one it cannot place in the bucket's output
        del part
    if rank >= senders:
        return None
    if unmatched and rank == 0 and whole:  # the engine expects these in FP8: publishing them as they are would load wrong
        raise RuntimeError(f"weights v{version}: FP8 tensors {sorted(unmatched)[:5]} are in no bucket of the "
                           f"published state ({len(unmatched)} in all): prl's name mapping for this model is wrong")
    meta = {"version": version, "format": "hf" if hf_format else "memory"}
    path = sink.seal(form.manifest(meta))
    if not whole and sink.share(sink.missed if rank == 0 else None):  # rank 0 gathers it all
        return publish(model, sink.folder, version, fp8_names, hf_format, form=form, parts=state, group=group)
    return path


class Background:
    """Versions published on a thread of their own, one at a time, in order, while the trainer goes on
    (`trainer.publish_overlap`): `wait()` waits for the version in flight (a failure there is raised here, in the
    trainer's thread); `submit(job)` waits too, then starts `job`. The job publishes frozen
    parts (`parts_of(..., frozen=True)`) over a process group of its own, so its collectives never meet the
    training step's. The thread is a daemon: a trainer that fails does not wait on it to exit, and a version it
    left unsealed never serves (the last sealed one does)."""

    def __init__(self, device: torch.device | None = None):
        """`device`: the trainer's CUDA device, made the thread's current one (a thread starts on device 0)."""
        self.device = device
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def submit(self, job) -> None:
        """Start `job` once the previous one finished."""
        self.wait()

        def run() -> None:
            try:
                if self.device is not None and self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                job()
            except BaseException as e:  # noqa: BLE001 - raised in the trainer's thread by the next wait
                self.error = e

        self.thread = threading.Thread(target=run, name="prl-publish", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error

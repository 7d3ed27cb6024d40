"""Expert parallelism: each MoE layer's routed experts split over the `ep` ranks, tokens sent to the
ranks that own their experts and brought back with all-to-all.

Transformers' MoE families (GLM-5, DeepSeek-V3, Qwen3-MoE; their expert classes are named by their
specs in `prl.model.families`) keep a layer's routed experts in one module with stacked weights
`gate_up_proj [E, 2I, D]` and `down_proj [E, D, I]`, called as
`experts(hidden_TD, topk_ids_TK, topk_weights_TK)`. `shard_experts` makes those two parameters
DTensors sharded on dim 0 over the `ep` mesh dimension (rank r owns experts r*E/ep ..) and swaps
the module's class for one whose forward:
  1. sorts the (token, slot) pairs by expert, so each destination rank's rows are contiguous;
  2. exchanges the per-expert counts (all-to-all of E integers), then the rows (all-to-all);
  3. runs each local expert on the rows it received (SwiGLU, as the HF eager path);
  4. sends the outputs back (all-to-all) and sums them into their tokens with the routing weights.
Both row exchanges are differentiable (their backward is the reverse exchange), so gradients reach
the router, the attention below and the experts. The routing ids come from the router or, with R3,
from the replayed ids: EP does not care which. The wire is `prl.trainer.ep_dispatch`'s: rows toward
the experts in block FP8 with `trainer.parallel.ep_dispatch = "fp8"`, and with `ep_node_dedup` a
token crosses to each node once and is spread inside it (steps 1-4 then run per hop, see there).

Overlap (`trainer.parallel.overlap`, `Comm.chunks` > 1): the tokens go through steps 1-4 in chunks,
one count exchange for all of them. Chunk c+1's rows are issued before chunk c's experts run and
chunk c-1's outputs are landed after them (`prl.trainer.overlap`: issued exchanges fly while the
caller computes), and the layer's shared experts (`AheadShared`) run while the first chunk travels
(plain dispatch; node dedup interleaves its chunks two at a time, `ep_dispatch.node_dedup_forward`).
Backward mirrors it. Every chunk is exchanged on every rank, empty ones too, so collectives match.

Gradients: FSDP averages the other parameters' gradients over all ranks. An expert's gradient
arrives summed over the tokens its `ep` group sent it; `reduce_expert_grads` sums it over the
replicas of that expert (ranks with the same `ep` coordinate, other data) and divides by the world
size, which is the same average. Expert weights are not also FSDP-sharded over the replicas yet:
with `ep` = world (the intended layout for a large MoE) there are none. FP8 expert stacks
(`trainer.fp8`) run their local experts through the same block-FP8 GEMMs as on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from prl.model import families
from prl.trainer.ep_dispatch import (Comm, Route, RowExchange, count, dedup_chunk, dedup_routes, node_dedup_forward,
                                     token_chunks)
from prl.trainer.overlap import issue, land, timed


def shard_experts(model, ep_mesh: DeviceMesh, per_node: int = 0, fp8: bool = False,
                  dedup: bool = False, chunks: int = 1, two_batch: bool = False) -> list[torch.nn.Parameter]:
    """Shard every experts module (the family spec's `expert_classes`, their `stacked_experts`
    tensors on `expert_dim`) over the mesh's `ep` dimension; returns the sharded parameters (FSDP
    must leave them alone). Every rank must hold the same full weights before the call. `per_node`
    (trainer ranks per node; 0: one node), `fp8`, `dedup`: the dispatch (`prl.trainer.ep_dispatch`); `two_batch`:
    the layers run halves of each micro-batch (`prl.trainer.two_batch`), their metadata on a group of its own."""
    ep = ep_mesh["ep"]
    fam = families.spec(model.config.model_type, f"trainer.parallel.ep = {ep.size()}")
    mods = families.modules_of(model, fam.expert_classes)
    if not mods:
        raise ValueError(f"trainer.parallel.ep = {ep.size()}: {type(model).__name__} has no stacked routed "
                         f"experts ({', '.join(fam.expert_classes)}) prl can split")
    comm = make_comm(ep, per_node, fp8, dedup, 1 if two_batch else chunks, two_batch)
    if chunks > 1 and not two_batch:
        ahead_shared(model, mods)
    return [p for m in mods for p in split_experts(m, ep, comm, fam.stacked_experts, fam.expert_dim)]


def ahead_shared(model, mods: list) -> None:
    """Each experts module's sibling `shared_experts` (GLM-5, DeepSeek-V3; Qwen3-MoE has none) made
    computable ahead, while the routed rows travel (`AheadShared`)."""
    for name, m in model.named_modules():
        if any(m is e for e in mods) and "." in name:
            shared = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "shared_experts", None)
            if isinstance(shared, torch.nn.Module):
                if not isinstance(shared, AheadShared):
                    shared.__class__ = type(f"Ahead{type(shared).__name__}", (AheadShared, type(shared)), {})
                shared._prl_ahead = None
                object.__setattr__(m, "_prl_shared", shared)  # a plain attribute: not a submodule of m


class AheadShared:
    """Mixin before a shared-experts MLP: `run_ahead(x_TD)` computes it on the layer's tokens early; the
    MoE block's own call on the same tokens (a [B, S, D] view of them) then returns that result. The tokens
    are held with the result, so their memory cannot be reused by other tokens while a result waits (after an
    exception between the two calls, say): a result is returned only for the same memory, size and version."""

    _prl_ahead: tuple | None

    def run_ahead(self, x_TD: torch.Tensor) -> None:
        self._prl_ahead = (x_TD, x_TD._version, super().forward(x_TD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ahead, self._prl_ahead = self._prl_ahead, None
        if ahead is not None and same_tokens(ahead[0], ahead[1], x):
            return ahead[2].view_as(x)
        return super().forward(x)


def same_tokens(held: torch.Tensor, version: int, x: torch.Tensor) -> bool:
    """`x` is `held` (or a view of all of it), unchanged since `version`."""
    return (held.data_ptr(), held.numel(), version) == (x.data_ptr(), x.numel(), x._version)


def make_comm(ep: DeviceMesh, per_node: int, fp8: bool, dedup: bool, chunks: int = 1, meta: bool = False) -> Comm:
    """The dispatch over a 1-D `ep` mesh, its ranks on nodes of `per_node` consecutive global ranks; `meta`: its
    counts, ids and routing weights on a second group of the same ranks."""
    ranks = dist.get_process_group_ranks(ep.get_group())
    nodes = tuple(r // per_node if per_node else 0 for r in ranks)
    return Comm(ep.get_group(), ep.size(), ep.get_local_rank(), nodes, fp8, dedup, chunks,
                twin_group(ep.get_group()) if meta else None)


def twin_group(group) -> object:
    """A new process group of `group`'s ranks (its own queue of collectives: on NCCL its own stream). Every
    rank creates every such group, in the same order, as `new_group` requires; this rank's is returned."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, dist.get_process_group_ranks(group))
    return dist.new_subgroups_by_enumeration([list(r) for r in sorted(set(map(tuple, every)))])[0]


def split_experts(m, ep: DeviceMesh, comm: Comm, names=("gate_up_proj", "down_proj"),
                  expert_dim: int = 0) -> list[torch.nn.Parameter]:
    """One experts module: its stacked tensors sharded over `ep`, its class swapped for the EP forward."""
    n_experts = m.gate_up_proj.shape[expert_dim]
    if n_experts % ep.size():
        raise ValueError(f"trainer.parallel.ep ({ep.size()}) must divide the model's experts ({n_experts})")
    params = []
    for name in names:
        full = getattr(m, name)
        p = torch.nn.Parameter(distribute_tensor(full.data, ep, [Shard(expert_dim)]), requires_grad=full.requires_grad)
        setattr(m, name, p)
        params.append(p)
    m.__class__ = type(f"EP{type(m).__name__}", (ExpertParallel, type(m)), {})
    m._prl_comm = comm
    m._prl_num_experts = n_experts
    return params


class ExpertParallel:
    """Mixin placed before the HF experts class: the all-to-all forward described above."""

    _prl_comm: Comm
    _prl_num_experts: int

    def forward(self, hidden_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        comm, E = self._prl_comm, self._prl_num_experts
        if comm.dedup:
            return node_dedup_forward(self, comm, hidden_TD, ids_TK, weights_TK, E // comm.size)
        parts = [Part.of(hidden_TD, ids, w, first) for first, ids, w in token_chunks(ids_TK, weights_TK, comm.chunks)]
        routes = expert_routes([p.flat for p in parts], comm, E)
        eager = len(parts) == 1  # serial: every exchange landed as soon as issued, in backward too

        def dispatch(c: int):
            return issue(parts[c].rows, RowExchange(routes[c][0], eager=eager))

        y = torch.zeros_like(hidden_TD)

        def combine(c: int, flight) -> torch.Tensor:
            got = land(*flight)
            return y.index_add(0, parts[c].tokens, (got * parts[c].weights[:, None].to(got.dtype)).to(y.dtype))

        sent, back = [dispatch(0)], []
        if not eager and getattr(self, "_prl_shared", None) is not None:
            self._prl_shared.run_ahead(hidden_TD)  # the shared experts run while the first rows travel
        for c in range(len(parts)):
            if c + 1 < len(parts):  # the next chunk travels while this one's experts run
                sent.append(dispatch(c + 1))
            out = self.local_experts(land(*sent[c]), routes[c][1], E // comm.size)
            back.append(issue(out, RowExchange(routes[c][0].reverse(), to_experts=False, eager=eager)))
            if c:  # the previous chunk's outputs came back while this one's experts ran
                y = combine(c - 1, back[c - 1])
        return combine(len(parts) - 1, back[-1])

    def two_batch(self, hidden_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, last=None):
        """A generator: this layer on one half of a micro-batch's tokens (`prl.trainer.two_batch`), yielding
        whenever its rows are on the wire (toward the experts, back), landing them when resumed; it returns
        the tokens' weighted expert outputs. Its counts travel first, on the metadata group; `last()` runs
        once the last rows are on their way back."""
        comm, E = self._prl_comm, self._prl_num_experts
        if comm.dedup:
            routes = dedup_routes(comm, ids_TK, weights_TK, E // comm.size)
            return (yield from dedup_chunk(self, comm, hidden_TD, routes, E // comm.size, False, last))
        part = Part.of(hidden_TD, ids_TK, weights_TK, 0)
        [(route, local_ids)] = expert_routes([part.flat], comm, E)
        sent = issue(part.rows, RowExchange(route, eager=False))
        yield
        out = self.local_experts(land(*sent), local_ids, E // comm.size)
        back = issue(out, RowExchange(route.reverse(), to_experts=False, eager=False))
        if last is not None:
            last()
        yield
        got = land(*back)
        y = torch.zeros_like(hidden_TD)
        return y.index_add(0, part.tokens, (got * part.weights[:, None].to(got.dtype)).to(y.dtype))

    def weighted_local(self, x_RD: torch.Tensor, ids_RK: torch.Tensor, w_RK: torch.Tensor) -> torch.Tensor:
        """Rows that each carry the local expert ids of their slots here (-1: another rank's) and the
        slots' routing weights: each row's experts run, their outputs weighted and summed per row."""
        r, j = (ids_RK >= 0).nonzero().unbind(1)
        out = self.local_experts(x_RD[r], ids_RK[r, j], self._prl_num_experts // self._prl_comm.size)
        return torch.zeros_like(x_RD).index_add(0, r, out * w_RK[r, j, None].to(out.dtype))

    def local_experts(self, x_RD: torch.Tensor, ids_R: torch.Tensor, local_E: int) -> torch.Tensor:
        """Each local expert's SwiGLU on its rows; block-scaled FP8 GEMMs where `apply_fp8` made the
        stack FP8 (this rank's slice of the stack is quantised as the whole one would be: per expert)."""
        from prl.model.fp8 import fp8_experts, fp8_linear

        linear = fp8_linear if fp8_experts(self) else torch.nn.functional.linear
        gate_up = local(self.gate_up_proj).to(x_RD.dtype)
        down = local(self.down_proj).to(x_RD.dtype)
        # `x_RD * 0`, not new zeros: the output stays in the graph when no row came here, so this
        # rank joins the backward all-to-all its peers run (else their exchange waits forever)
        out = x_RD * 0
        for e in range(local_E):
            rows = (ids_R == e).nonzero()[:, 0]
            if rows.numel() == 0:
                continue
            gate, up = linear(x_RD[rows], gate_up[e]).chunk(2, dim=-1)
            out = out.index_add(0, rows, linear(self.act_fn(gate) * up, down[e]))
        return out


@dataclass
class Part:
    """One chunk of a micro-batch's tokens as the experts see it: its (token, slot) rows sorted by expert."""

    flat: torch.Tensor  # [R] expert id of each row, unsorted (token-major)
    rows: torch.Tensor  # [R, D] the rows, sorted by expert
    tokens: torch.Tensor  # [R] the micro-batch token of each sorted row
    weights: torch.Tensor  # [R] its routing weight

    @staticmethod
    def of(hidden_TD: torch.Tensor, ids_tK: torch.Tensor, w_tK: torch.Tensor, first: int) -> "Part":
        K = ids_tK.shape[1]
        flat = ids_tK.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        tokens = first + order // K
        return Part(flat, hidden_TD[tokens], tokens, w_tK.reshape(-1)[order])


def expert_routes(flats: list[torch.Tensor], comm: Comm, n_experts: int) -> list[tuple[Route, torch.Tensor]]:
    """The plain dispatch's route of each chunk's rows sorted by expert, from one exchange of the
    per-expert counts (`local_E` int64 per chunk and peer), and the local expert id of every row each
    chunk receives (in the order they arrive: by source rank, then expert)."""
    local_E, n = n_experts // comm.size, len(flats)
    send = torch.stack([torch.bincount(f, minlength=n_experts).view(comm.size, local_E) for f in flats], dim=1)
    recv = torch.empty_like(send)  # [peer, chunk, local expert]
    timed(lambda: dist.all_to_all_single(recv, send.contiguous(), group=comm.group_for("meta")))
    count(comm, [local_E * n] * comm.size, send.element_size(), "meta", "forward")
    ids = torch.arange(local_E, device=send.device).repeat(comm.size)
    return [(Route(comm, send[:, c].sum(1).tolist(), recv[:, c].sum(1).tolist()),
             ids.repeat_interleave(recv[:, c].reshape(-1))) for c in range(n)]


def local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def reduce_expert_grads(params: list[torch.nn.Parameter], replicas: DeviceMesh | None, world: int) -> None:
    """Turn each expert's gradient (summed over the tokens of its ep group) into the average over
    all ranks that FSDP gives the other parameters. An expert no token reached on this rank gets a
    zero gradient first: every rank must join the same collectives."""
    for p in params:
        if not p.requires_grad:  # frozen (LoRA's base): no gradient to average
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = local(p.grad)
        if replicas is not None and replicas.size() > 1:
            dist.all_reduce(g, group=replicas.get_group())
        g.div_(world)

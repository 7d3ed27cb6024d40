"""The wire under expert parallelism: how rows travel between the `ep` ranks, and what it costs.

`send(rows, route)` is a differentiable all-to-all whose backward is the reverse exchange. It knows
which way it goes: toward the experts (the dispatch, and in backward the combine's gradient) or
back toward the tokens (the combine, and in backward the dispatch's gradient). With
`trainer.parallel.ep_dispatch = "fp8"` what goes toward the experts travels as block FP8: each row
quantised in 1x128 tiles along the hidden dim (`prl.model.fp8.quantize_tiles`), its D E4M3 bytes
and ceil(D/128) fp32 scales packed into one byte row (one collective), dequantised to the compute
dtype on arrival. Rows going back toward the tokens stay in the compute dtype: they are summed with
the routing weights into the residual stream, and their error would add up over the k experts (as
DeepEP's combine, which is bf16 only). The forward value of an FP8 row is exactly
`dequantize(quantize_tiles(row))`; its gradient passes straight through (the quantisation's
derivative is taken as 1, as for any FP8 cast in training).

`node_dedup_forward` (`ep_node_dedup`) sends a token once to each node holding any of its experts,
to the rank there with the sender's own index inside its node (its rail peer), which forwards it
once to each rank of that node holding one of the token's experts, with the ids and routing weights
of those slots. The expert rank weights and sums its slots' outputs; the forwarder sums its node's
rows; one row per (token, node) goes back across nodes. Lossless: the same products, summed in
another order. Ranks are grouped into nodes of `per_node` consecutive `ep` ranks (torchrun numbers
a host's ranks consecutively); on one CPU host `ep_ranks_per_node` simulates nodes.

`TRAFFIC` counts the bytes this rank sent to other ranks, keyed (pass, what, link): pass "forward"
or "backward", what "to_experts", "to_tokens" or "meta" (counts, ids, routing weights), link "node"
(another rank of this node) or "net" (another node). Rows a rank keeps for itself are not counted.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from prl.model.fp8 import BLOCK, E4M3, Quantized, dequantize, quantize_tiles
from prl.trainer.overlap import Exchange, Flight, exchange, issue, land, timed

TRAFFIC: Counter = Counter()


@dataclass(frozen=True)
class Comm:
    """The `ep` group as the dispatch sees it."""

    group: object
    size: int  # ep
    rank: int  # this rank's index in the ep group
    nodes: tuple[int, ...]  # the node of each ep rank (global rank // ranks per node)
    fp8: bool = False  # rows toward the experts in block FP8
    dedup: bool = False  # node-level deduplication
    chunks: int = 1  # token chunks pipelined through the experts (1: serial; `prl.trainer.expert_parallel`)
    meta: object = None  # the group counts, ids and routing weights travel on (None: `group`); two-batch overlap
    # gives them their own, so they never queue behind the other half's rows in flight (`prl.trainer.two_batch`)

    def group_for(self, what: str):
        return self.meta if what == "meta" and self.meta is not None else self.group

    @property
    def per_node(self) -> int:
        """Ep ranks per node: consecutive, whole nodes or one (`ParallelCfg.ranks_per_node` checks it)."""
        return self.size // len(set(self.nodes))


@dataclass(frozen=True)
class Route:
    """Rows to each ep rank (`send`) and from each (`recv`), in ep-rank order."""

    comm: Comm
    send: list[int]
    recv: list[int]

    def reverse(self) -> "Route":
        return Route(self.comm, self.recv, self.send)


def count(comm: Comm, send: list[int], row_bytes: int, what: str, phase: str) -> None:
    for r, n in enumerate(send):
        if r != comm.rank and n:
            link = "node" if comm.nodes[r] == comm.nodes[comm.rank] else "net"
            TRAFFIC[(phase, what, link)] += n * row_bytes


def route_of(dest: torch.Tensor, comm: Comm) -> Route:
    """The route of rows sorted by destination ep rank `dest`: counts exchanged (one int64 per peer)."""
    send = torch.bincount(dest, minlength=comm.size)
    recv = torch.empty_like(send)
    timed(lambda: dist.all_to_all_single(recv, send, group=comm.group_for("meta")))
    count(comm, [1] * comm.size, send.element_size(), "meta", "forward")
    return Route(comm, send.tolist(), recv.tolist())


def pack(rows_RD: torch.Tensor) -> torch.Tensor:
    """[R, D] -> uint8 [R, D + 4 ceil(D/128)]: E4M3 values, then the fp32 scales of the 1x128 tiles."""
    if rows_RD.shape[0] == 0:  # a chunk with no row for anyone (its shape still names the row size)
        return torch.empty(0, rows_RD.shape[1] + 4 * math.ceil(rows_RD.shape[1] / BLOCK), dtype=torch.uint8,
                           device=rows_RD.device)
    q = quantize_tiles(rows_RD)
    return torch.cat([q.q.view(torch.uint8), q.scale.contiguous().view(torch.uint8)], dim=1)


def unpack(buf: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    if buf.shape[0] == 0:
        return torch.empty(0, d, dtype=dtype, device=buf.device)
    scale = buf[:, d:].contiguous().view(torch.float32)
    q = buf[:, :d].contiguous().view(E4M3)
    assert scale.shape[1] == math.ceil(d / BLOCK)
    return dequantize(Quantized(q, scale, (1, BLOCK))).to(dtype)


def wire(rows: torch.Tensor, route: Route, fp8: bool, what: str, phase: str) -> Flight:
    """One all-to-all of rows along `route` (not differentiable), counted, in flight."""
    payload = pack(rows) if fp8 else rows.contiguous()
    out = payload.new_empty(sum(route.recv), *payload.shape[1:])
    work = dist.all_to_all_single(out, payload, route.recv, route.send, group=route.comm.group_for(what),
                                  async_op=True)
    count(route.comm, route.send, payload.element_size() * math.prod(payload.shape[1:]), what, phase)
    d, dtype = rows.shape[1], rows.dtype
    return Flight(work, (lambda: unpack(out, d, dtype)) if fp8 else (lambda: out), keep=payload)


class RowExchange(Exchange):
    """Rows along a route forward, the reverse route backward; FP8 whichever way goes toward the experts."""

    def __init__(self, route: Route, to_experts: bool = True, meta: bool = False, eager: bool = True):
        self.route, self.to_experts, self.meta, self.eager = route, to_experts, meta, eager

    def forward(self, x: torch.Tensor) -> Flight:
        return wire(x, self.route, *how(self.route.comm, self.to_experts, self.meta), "forward")

    def backward(self, grad: torch.Tensor) -> Flight:
        back = self.route.reverse()
        return wire(grad, back, *how(back.comm, not self.to_experts, self.meta), "backward")


def how(comm: Comm, to_experts: bool, meta: bool) -> tuple[bool, str]:
    """(FP8?, what) for rows going one way."""
    if meta:
        return False, "meta"
    return comm.fp8 and to_experts, "to_experts" if to_experts else "to_tokens"


def send(rows: torch.Tensor, route: Route, to_experts: bool = True, meta: bool = False) -> torch.Tensor:
    """Differentiable all-to-all of rows (`meta`: routing weights, never quantised), landed at once."""
    return exchange(rows, RowExchange(route, to_experts, meta))


def send_ints(x: torch.Tensor, route: Route) -> torch.Tensor:
    return wire(x, route, False, "meta", "forward").land()


# ---------------------------------------------------------------- node-level deduplication
def hop(ids_RK, w_RK, dest_RK, comm: Comm):
    """Where each row goes: once to every ep rank named in its `dest_RK` (-1: none), with the expert ids
    and weights of the slots bound there (the others -1 and 0). Returns the source row of each copy
    sent, the route, and what arrives with the rows: ids and weights (exchanged here; the rows, the
    large part, are the caller's to send)."""
    R = ids_RK.shape[0]
    hit = torch.zeros(comm.size, R, dtype=torch.bool, device=ids_RK.device)
    valid = dest_RK >= 0
    rows = torch.arange(R, device=ids_RK.device)[:, None].expand_as(dest_RK)
    hit[dest_RK[valid], rows[valid]] = True
    dest, row = hit.nonzero().unbind(1)  # by destination, then row
    keep = dest_RK[row] == dest[:, None]
    route = route_of(dest, comm)
    ids = torch.where(keep, ids_RK[row], -1).to(torch.int32)
    w = torch.where(keep, w_RK[row], torch.zeros((), dtype=w_RK.dtype, device=w_RK.device))
    return row, route, send_ints(ids, route).long(), send(w, route, meta=True)


def owners(ids_RK: torch.Tensor, local_E: int) -> torch.Tensor:
    """The ep rank holding each slot's expert (-1 for an empty slot)."""
    return torch.where(ids_RK >= 0, ids_RK // local_E, -1)


def token_chunks(ids_TK: torch.Tensor, w_TK: torch.Tensor, n: int):
    """(first token, ids, weights) of `n` consecutive chunks of the tokens, empty ones too: every rank
    runs the same exchanges whatever its number of tokens."""
    T = ids_TK.shape[0]
    bounds = [T * c // n for c in range(n + 1)]
    return [(a, ids_TK[a:b], w_TK[a:b]) for a, b in zip(bounds, bounds[1:])]


def interleave(jobs: list, window: int) -> list:
    """Run generator `jobs` `window` at a time, each advanced to its next `yield` (a point where it
    would wait for an exchange it has issued) in turn; returns what each returned. The order depends
    on nothing but the jobs' count, so every rank issues the same exchanges in the same order."""
    results, active, started = [None] * len(jobs), [], 0
    while started < len(jobs) or active:
        while len(active) < window and started < len(jobs):
            active.append(started)
            started += 1
        for j in list(active):
            try:
                next(jobs[j])
            except StopIteration as done:
                results[j] = done.value
                active.remove(j)
    return results


def node_dedup_forward(experts, comm: Comm, x_TD, ids_TK, w_TK, local_E: int) -> torch.Tensor:
    """Dispatch across nodes once per (token, node), then inside the node once per (token, rank);
    `experts.weighted_local(x, ids, w)` runs this rank's experts and sums each row's weighted slots.
    With `comm.chunks` > 1 the tokens go in chunks, two at a time: one's rows travel while the other's
    experts run. Every chunk's routes, ids and weights are exchanged first (blocking exchanges, which
    on one NCCL stream would queue behind rows in flight), then only rows travel."""
    eager = comm.chunks == 1
    chunks = token_chunks(ids_TK, w_TK, comm.chunks)
    routes = [dedup_routes(comm, ids, w, local_E) for _, ids, w in chunks]
    jobs = [dedup_chunk(experts, comm, x_TD[a: a + ids.shape[0]], r, local_E, eager)
            for (a, ids, _), r in zip(chunks, routes)]
    return torch.cat(interleave(jobs, 1 if eager else 2))


def dedup_routes(comm: Comm, ids_tK, w_tK, local_E: int) -> tuple:
    """Both hops' routes of one chunk: the rail peer on each owner's node, then the owners there."""
    owner = owners(ids_tK.long(), local_E)
    per = comm.per_node
    rail = torch.where(owner >= 0, owner // per * per + comm.rank % per, -1)  # the rail peer on the owner's node
    tok, r1, ids1, w1 = hop(ids_tK.long(), w_tK, rail, comm)
    got, r2, ids2, w2 = hop(ids1, w1, owners(ids1, local_E), comm)
    return tok, r1, got, r2, ids2, w2


def dedup_chunk(experts, comm: Comm, x_tD, routes: tuple, local_E: int, eager: bool, last=None):
    """One chunk of `node_dedup_forward` along its `dedup_routes`, yielding while its rows travel; `last()`
    runs once the last rows are on the wire (back to the tokens)."""
    tok, r1, got, r2, ids2, w2 = routes
    sent = issue(x_tD[tok], RowExchange(r1, eager=eager))
    yield
    x1 = land(*sent)
    sent = issue(x1[got], RowExchange(r2, eager=eager))
    yield
    y2 = experts.weighted_local(land(*sent), ids2 - comm.rank * local_E, w2)
    sent = issue(y2, RowExchange(r2.reverse(), to_experts=False, eager=eager))
    yield
    y1 = torch.zeros_like(x1).index_add(0, got, land(*sent))
    sent = issue(y1, RowExchange(r1.reverse(), to_experts=False, eager=eager))
    if last is not None:
        last()
    yield
    return torch.zeros_like(x_tD).index_add(0, tok, land(*sent).to(x_tD.dtype))

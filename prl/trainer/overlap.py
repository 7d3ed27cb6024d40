"""Exchanges in flight while the trainer computes, and the clock that says how much of them it waited for.

A differentiable collective (the experts' all-to-all, context parallelism's gather) is two autograd
nodes here, not one: `issue` starts it (async) and returns a token, `land` waits for it and returns
what arrived. Whatever the caller computes between the two, and does not depend on the exchange,
runs while the rows are on the wire. Backward mirrors it: the gradient reaching `land` starts the
reverse exchange there and the one reaching `issue` waits for it, so the autograd nodes created
between them in forward (run in reverse creation order: the CPU engine runs the ready node created
last, which makes backward the exact reverse of forward) compute while the gradients travel.
`exchange(..., eager=True)` lands at once in both passes: the serial step, identical collectives.

Every rank issues the same collectives in the same order (the same modules, chunks and reverse
order), as the collectives' matching needs; a peer that dies mid-exchange fails the wait with
the backend's error (gloo: the connection closed) or its timeout, and the step fails.

`CLOCK` measures, per step, the wall time some exchange was on the wire (the union of issue-to-done
intervals: `comm_s`) and the time the trainer waited for one (`exposed_comm_s`); their difference
is the exchange time hidden behind compute. It counts the experts' exchanges and context
parallelism's gathers; FSDP's own gathers and reductions (prefetched a layer ahead by FSDP2) are
not counted.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


class Clock:
    """Issue-to-done intervals of the step's exchanges, and the seconds spent waiting for them."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.spans: list[tuple[float, float]] = []
            self.waited = 0.0
            self.marks: list[tuple[float, float]] = []  # (when, waited by then): each backward's start
            self.started = time.perf_counter()

    def mark(self) -> None:
        """A micro-batch's backward starts: what came before is its forward (`forward_figures`)."""
        with self.lock:
            self.marks.append((time.perf_counter(), self.waited))

    def span(self, start: float, end: float) -> None:
        with self.lock:  # called from the backend's thread when an exchange completes
            self.spans.append((start, end))

    def wait(self, seconds: float) -> None:
        with self.lock:
            self.waited += seconds

    def figures(self) -> tuple[float, float]:
        """(seconds some exchange was in flight, seconds the trainer waited on one)."""
        with self.lock:
            busy, waited = union(sorted(self.spans)), self.waited
        return busy, min(waited, busy)

    def forward_figures(self) -> tuple[float, float, float] | None:
        """The first micro-batch's forward: (its wall seconds from the step's reset, seconds its exchanges
        were in flight, seconds waited); None before a backward started."""
        with self.lock:
            if not self.marks:
                return None
            (when, waited), start = self.marks[0], self.started
            spans = sorted(s for s in self.spans if s[0] < when)
        return when - start, union(spans), waited


def union(spans: list[tuple[float, float]]) -> float:
    """The seconds covered by sorted intervals."""
    busy, reach = 0.0, float("-inf")
    for a, b in spans:
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    return busy


CLOCK = Clock()


@dataclass
class Flight:
    """One collective in flight: its work handle, and what turns its buffer into the result."""

    work: object
    done: Callable[[], torch.Tensor]
    keep: object = None  # what is being sent: alive until the exchange is done
    start: float = field(default_factory=time.perf_counter)
    untimed: bool = field(default=False, init=False)  # no future: in flight until landed, as far as the clock can tell

    def __post_init__(self):
        start = self.start
        try:
            self.work.get_future().then(lambda _fut: CLOCK.span(start, time.perf_counter()))
        except RuntimeError:  # a work without a future (gloo's reduce-scatter over more than 2 ranks)
            self.untimed = True

    def land(self) -> torch.Tensor:
        t = time.perf_counter()
        self.work.wait()
        now = time.perf_counter()
        CLOCK.wait(now - t)
        if self.untimed:
            CLOCK.span(self.start, now)
        self.keep = None
        return self.done()


class Exchange:
    """One differentiable exchange: `forward(x)` and `backward(grad)` each start a collective and
    return its Flight. Subclasses say which."""

    eager = False

    def forward(self, x: torch.Tensor) -> Flight:
        raise NotImplementedError

    def backward(self, grad: torch.Tensor) -> Flight:
        raise NotImplementedError


class _Issue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ex: Exchange):
        ctx.ex = ex
        ex.flight = ex.forward(x)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token):
        ex = ctx.ex
        grad, ex.back = ex.back.land() if isinstance(ex.back, Flight) else ex.back, None
        return grad, None


class _Land(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, ex: Exchange):
        ctx.ex, ctx.dtype = ex, token.dtype
        out, ex.flight = ex.flight.land(), None
        return out

    @staticmethod
    def backward(ctx, grad):
        ex = ctx.ex
        flight = ex.backward(grad.contiguous())
        ex.back = flight.land() if ex.eager else flight
        return torch.empty(0, dtype=ctx.dtype, device=grad.device), None


def issue(x: torch.Tensor, ex: Exchange) -> tuple[torch.Tensor, Exchange]:
    """Start `ex` on `x`; `land(*issue(x, ex))` is the exchange's result."""
    return _Issue.apply(x, ex), ex


def land(token: torch.Tensor, ex: Exchange) -> torch.Tensor:
    return _Land.apply(token, ex)


def exchange(x: torch.Tensor, ex: Exchange) -> torch.Tensor:
    """Issued and landed at once, in forward and (with `ex.eager`) in backward."""
    return land(*issue(x, ex))


def timed(run: Callable[[], None]) -> None:
    """A blocking collective, counted as in flight and waited for the whole time."""
    t = time.perf_counter()
    run()
    now = time.perf_counter()
    CLOCK.span(t, now)
    CLOCK.wait(now - t)

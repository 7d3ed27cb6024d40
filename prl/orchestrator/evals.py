"""Eval sets inside a run: scheduled on the weights versions, run on the same servers as rollouts.

Rules:
- set s scores version p at each of its points p (`EvalCfg.points`: 0, every N steps, the last);
  it starts once the servers serve version p, and the batch of step p (which makes version p + 1)
  ships only after it started, so it starts under version p itself (a resumed run's point that
  the servers are already past starts under the version they serve: `version` says which);
- its requests go through the pool like a group's (same servers, retries, P/D), beside the rollouts
  and not in their count (training keeps its whole in-flight budget), never more than `max_share` of
  that budget (`ShareGate`: the budget read as each example starts; an example that does not fit
  waits, and its wait is demand the budget grows for while the servers' KV has room); weights update under it
  as under any rollout, and `later_share` reports the tokens sampled under a newer version (a set
  with `pin_version` holds new weights back from the servers until it ends instead: `pinned`);
- its samples are never trained on and never touch the data cursor;
- each (set, point) is logged once as an `eval` event: a restarted orchestrator reads the events
  logged and runs only the points missing; where several points of a set are missing whose weights
  the servers no longer serve (a set added on resume), only the newest runs, under the version
  served, and the others are reported as skipped (`eval_skipped`);
- a set that fails is reported (`eval_failed`, with the error) and training goes on.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from prl.evaluation.runner import run_set
from prl.evaluation.sets import EvalSet
from prl.metrics import read_events
from prl.usercode import described


def logged_points(metrics_path) -> set[tuple[str, int]]:
    events, _ = read_events(metrics_path)
    return {(e["set"], e["step"]) for e in events if e.get("kind") == "eval" and "set" in e and "step" in e}


class ShareGate:
    """Admits a set's examples while its samples in flight, with the next example's, stay within `share`
    of the in-flight budget (`budget()`, read at each admission: it follows the servers' KV and the servers
    up); an example that does not fit waits under `changed` for one of the set's to end or the budget to grow."""

    def __init__(self, share: float, samples: int, budget: Callable[[], int], changed: asyncio.Condition):
        self.share, self.samples, self.budget, self.changed = share, samples, budget, changed
        self.held = 0  # the set's samples in flight
        self.waiting = 0  # its examples waiting to start

    def fits(self) -> bool:
        return self.held + self.samples <= self.share * self.budget()

    def wanted(self) -> int:
        """The budget that would start the next waiting example (0: none waits)."""
        return math.ceil((self.held + self.samples) / self.share) if self.waiting else 0

    async def __aenter__(self) -> None:
        async with self.changed:
            self.waiting += 1
            try:
                await self.changed.wait_for(self.fits)
            finally:
                self.waiting -= 1
            self.held += self.samples

    async def __aexit__(self, *exc) -> None:
        async with self.changed:
            self.held -= self.samples
            self.changed.notify_all()


class InRunEvals:
    def __init__(self, orch, sets: list[EvalSet], max_steps: int):
        self.orch, self.sets = orch, {s.name: s for s in sets}
        done = logged_points(orch.log.path)
        self.waiting = sorted((p, s.name) for s in sets for p in s.cfg.points(max_steps) if (s.name, p) not in done)
        self.tasks: set[asyncio.Task] = set()
        self.pinned = 0  # running sets that hold weight loads back (pin_version)
        self.gates: set[ShareGate] = set()  # of the running sets

    def held_out_from(self) -> int | None:
        """The first index of a set that draws from the training task's stream (training stops short of it)."""
        firsts = [s.first for s in self.sets.values() if s.cfg.draws_training_data(self.orch.cfg.task)]
        return min(firsts, default=None)

    def wanted(self) -> int:
        """The in-flight budget a running set waits for (0: none waits): demand, like rollouts in flight."""
        return max((g.wanted() for g in self.gates), default=0)

    def started_through(self, step: int) -> bool:
        """Whether every point up to `step` has started (the batch of `step` may ship)."""
        return not self.waiting or self.waiting[0][0] > step

    async def watch(self) -> None:
        """Start each point as soon as the servers serve its version (under `orch.changed`)."""
        orch = self.orch
        while self.waiting:
            async with orch.changed:
                await orch.changed.wait_for(lambda: self.waiting[0][0] <= orch.served)
                due = self.newest_per_set([w for w in self.waiting if w[0] <= orch.served])
                self.waiting = [w for w in self.waiting if w[0] > orch.served]
                for point, name in due:  # started before anyone sees `waiting` without them
                    self.pinned += self.sets[name].cfg.pin_version
                    task = asyncio.create_task(orch.guard(self.run_point(self.sets[name], point, orch.served)))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                orch.changed.notify_all()

    def newest_per_set(self, due: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """Of the points due at once, each set's newest; the older ones are reported skipped."""
        newest = {name: point for point, name in sorted(due)}
        for name in sorted(newest):
            older = [p for p, n in due if n == name and p != newest[name]]
            if older:
                self.orch.log.emit("eval_skipped", set=name, steps=older, version=self.orch.served,
                                   reason="their weights are no longer served")
        return sorted((point, name) for name, point in newest.items())

    async def run_point(self, s: EvalSet, point: int, version: int) -> None:
        orch = self.orch
        gate = ShareGate(s.cfg.max_share, s.cfg.samples, orch.inflight_budget, orch.changed)
        self.gates.add(gate)
        started = time.time()
        try:
            figures = await run_set(s, orch.eval_sampler, gate, version,
                                    keep=lambda indices, groups: orch.samples.write_eval(s.name, point, indices, groups))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - an eval that fails is reported; training goes on
            orch.log.emit("eval_failed", set=s.name, step=point, version=version,
                          line=described(e)[:400])  # the user's task or environment: its function, file and line
            return
        finally:
            self.gates.discard(gate)
            if s.cfg.pin_version:
                async with orch.changed:
                    self.pinned -= 1
                    orch.changed.notify_all()
        orch.log.emit("eval", set=s.name, step=point, version=version, examples=s.examples,
                      samples=s.cfg.samples, verbatim_share=s.verbatim_share, replaced=s.replaced,
                      started=round(started, 3), **figures)

    async def finish(self) -> None:
        """Every point started and logged (the last ones once the final version is served)."""
        orch = self.orch
        while self.waiting or self.tasks:
            if self.tasks:
                await asyncio.gather(*list(self.tasks))
            else:
                async with orch.changed:
                    await orch.changed.wait_for(lambda: not self.waiting or bool(self.tasks) or orch.error)
            if orch.error:
                raise orch.error

"""The embedded server's end of the collective weight path (`prl.transport.collective`).

`join` forms the server's member of the trainer's group (a new epoch replaces the old group);
`receive` takes one version off the wire and stages it, checked whole against the model
(`make_policy`); `take` hands `/update_weights` the newest staged version at or after the one the
orchestrator asks for (a trainer that runs ahead streams the next before the orchestrator asked
for the last: newer weights are always acceptable, each token is labelled with the version that
produced it). The newest `KEEP` versions stay staged until then. Nothing here touches the served
model: a receive that fails drops what it had, leaves the old version serving, and the group is
gone until the trainer forms a new one.
"""

from __future__ import annotations

import threading
import time

from prl.inference.engine import Policy, WeightLoadError, make_policy
from prl.model.fp8_checkpoint import SCALE_SUFFIX
from prl.transport.collective import GroupInfo, Wire, WireError, expected_tensors


KEEP = 2  # versions staged at once (each a copy of the model in host memory)


class ReceiveError(RuntimeError):
    pass


class Receiver:
    def __init__(self, model, base=None):
        self.model = model
        self.base = base  # LoRA: the adapters' base (`prl.model.lora.AdapterBase`)
        self.expected = None  # name -> (shape, max bytes), computed on first use
        self.wire: Wire | None = None
        self.staged: dict[int, Policy] = {}  # version -> staged, the newest KEEP
        self.lock = threading.Lock()  # the wire: one receive at a time; a join waits for it
        self.slot = threading.Lock()  # the staged version
        self.on_wire: int | None = None  # the version being received
        self.received = 0  # versions staged from the collective
        self.receiving = -1  # tensors of the version on the wire so far (-1: no receive running)

    def device(self):
        """The model's device: an NCCL member's; its kind picks the group's backend ("cuda": NCCL)."""
        return next(self.model.parameters()).device

    def join(self, info: GroupInfo) -> None:
        """Blocks until every member joined (or the group's timeout)."""
        with self.lock:
            self.wire = None
            self.wire = Wire(info, device=self.device())

    def receive(self, version: int, epoch: int) -> dict:
        with self.lock:
            if self.wire is None or self.wire.info.epoch != epoch:
                have = self.wire.info.epoch if self.wire else None
                raise ReceiveError(f"not a member of group epoch {epoch} (this server's: {have}); form it anew")
            t0, self.receiving, self.on_wire = time.perf_counter(), 0, version
            try:
                tensors, meta = self.wire.receive(self._expected(), on_tensor=self._count)
                if int(meta.get("version", -1)) != version:
                    raise WireError(f"the wire carried v{meta.get('version')}, not v{version}")
                policy = make_policy(self.model, tensors, version, f"v{version} from the collective", meta, self.base)
            except (RuntimeError, WeightLoadError, ValueError, TypeError, KeyError) as e:  # gloo: RuntimeError
                self.wire.close()  # the group goes now: on gloo the sender fails at once (NCCL: at its timeout)
                self.wire = None
                raise ReceiveError(f"v{version}: {type(e).__name__}: {e}") from None
            finally:
                self.receiving, self.on_wire = -1, None
            with self.slot:
                self.staged[version] = policy
                for old in sorted(self.staged)[:-KEEP]:
                    del self.staged[old]
            self.received += 1
            return {"version": version, "seconds": time.perf_counter() - t0,
                    "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}

    def _count(self) -> None:
        self.receiving += 1

    def take(self, version: int) -> Policy | None:
        """The newest staged policy at or after `version` (then no longer staged), None if there is
        none. Waits only for a receive of that very version; a load of another never queues behind
        the wire."""
        if self.on_wire == version:
            with self.lock:
                pass
        with self.slot:
            newest = max((v for v in self.staged if v >= version), default=None)
            if newest is None:
                return None
            policy = self.staged.pop(newest)
            self.staged = {v: p for v, p in self.staged.items() if v > newest}  # older ones will not be asked for
            return policy

    def holds(self, version: int) -> bool:
        """Whether `version` is staged or on the wire."""
        return self.on_wire == version or version in self.staged

    def _expected(self):
        if self.expected is None:
            self.expected = expected_tensors(self.model, SCALE_SUFFIX)
        return self.expected

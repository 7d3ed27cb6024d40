"""vLLM's end of the collective weight path (`prl.transport.collective`): gloo on CPU, NCCL where the
workers hold GPUs (each worker on its own).

The trainer talks to a vLLM server as to the embedded one (`/weights/collective/members`, `join`,
`receive`); prl's middleware in vLLM's API server (`prl.backends.vllm.auth`) answers those routes
by handing the call to every worker through vLLM's own `init_weight_transfer_engine` RPC (the only
worker entry that needs no weight-update session), where prl's weight engine (`plugin.py`):
- join: each worker joins the trainer's group as rank `first + its worker rank`;
- receive: starts the stager's thread, which takes the version off the wire, checks it as a fetched
  folder is checked (every name and shape of the served checkpoint, finite values; a LoRA adapter
  version merged into its base, `PrlWeightEngine.merge`) and marks it ready. The middleware then waits for "ready" in the staging status (`prl.backends.vllm.staging`)
  and answers. When the orchestrator then asks for that version, the stager already holds it and
  the usual pause/load/resume runs; a failed receive leaves the old version serving and the
  orchestrator's stage reads the folder instead.
"""

from __future__ import annotations

import asyncio
import json
import math
import os

from prl.backends.vllm.launch import replica_tp
from prl.transport.collective import GroupInfo, Wire, WireError, adapter_entries, local_device

MEMBERS = "/weights/collective/members"
JOIN = "/weights/collective/join"
RECEIVE = "/weights/collective/receive"
PATHS = (MEMBERS, JOIN, RECEIVE)


# ---------------------------------------------------------------- in the worker (plugin)
def join(info, worker: int, device) -> Wire:
    """This worker's member of the trainer's group: rank = the server's first rank + its worker rank, on
    the worker's own device (NCCL)."""
    return Wire(GroupInfo(info.addr, info.port, info.world, info.rank + worker, info.epoch, info.timeout_s,
                          info.backend, info.senders), device=device)


def receive_read(engine, wire: Wire):
    """The stager's read for one version off `wire` (checked like a folder; a failure drops the group)."""
    def read(version: int) -> dict:
        try:
            share = engine.expected_share()
            wanted = {k: (list(s), math.prod(s) * 4) for k, s in share.items()}
            tensors, meta = wire.receive({**wanted, **adapter_entries(share)})
            if int(meta.get("version", -1)) != version or meta.get("format") != "hf":
                raise WireError(f"the wire carried v{meta.get('version')} ({meta.get('format')}), not v{version} (hf)")
            return engine.staged(f"v{version} from the collective", tensors, meta, share)
        except BaseException:
            wire.close()  # drops the group now: on gloo the sender fails at once (NCCL: at its timeout)
            engine.wire = None
            raise

    return read


# ---------------------------------------------------------------- in the API server (middleware)
def members(cfg) -> int:
    """Workers of this server, each a member of the group (tensor x data parallel)."""
    opts = cfg.inference.vllm
    tp = int(opts.get("tensor_parallel_size", 0)) or replica_tp(cfg)
    return max(tp, 1) * int(opts.get("data_parallel_size", cfg.inference.data_parallel_size))


def shares(cfg, n: int, experts: int) -> list[list[int] | None]:
    """The experts each of the server's `n` workers serves: all without expert parallelism; with it,
    vLLM's linear placement of the physical slots (the experts plus `inference.redundant_experts`) over
    the workers (expert-parallel rank = data-parallel rank x tp + tensor rank, the member order):
    contiguous, the remainder on the first ranks, each slot loaded with its logical expert
    (`logical`). Each worker checks what it receives against its own model's expert map, so a
    placement that differs fails the version by name (it then comes whole by the folder)."""
    if not (cfg.inference.expert_parallel or cfg.inference.vllm.get("enable_expert_parallel")) or n == 1 or not experts:
        return [None] * n
    slots = experts + cfg.inference.redundant_experts
    base, rem = divmod(slots, n)
    out = []
    for r in range(n):
        start = r * base + min(r, rem)
        out.append(sorted({logical(p, experts) for p in range(start, start + base + (r < rem))}))
    return out


def logical(slot: int, experts: int) -> int:
    """The expert a physical slot is loaded with: vLLM's initial EPLB arrangement (the experts in order,
    then the redundant slots cycling through them), which its weight loading follows."""
    return slot if slot < experts else (slot - experts) % experts


async def handle(request, cfg):
    """One of `PATHS` (the bearer check already passed)."""
    from starlette.responses import JSONResponse

    if request.url.path == MEMBERS:
        n = members(cfg)
        return JSONResponse({"members": n, "device": local_device(), "experts": shares(cfg, n, routed_experts(cfg))})
    try:
        body = json.loads(await request.body() or b"{}")
        if request.url.path == JOIN:
            return JSONResponse(await _join(request, body))
        return JSONResponse(await _receive(request, cfg, body))
    except (ValueError, TypeError) as e:
        return JSONResponse({"detail": str(e)[:1000]}, status_code=400)
    except Exception as e:  # noqa: BLE001 - a worker's error comes back through vLLM's RPC
        return JSONResponse({"detail": f"{type(e).__name__}: {e}"[:1000]}, status_code=409)


def routed_experts(cfg) -> int:
    """The model's routed experts (0 for a dense model), from its config.json."""
    from prl.model.families import routed_experts as of_config

    return int(of_config(json.loads((cfg.model_dir / "config.json").read_text())) or 0)


async def _init(request, info: dict) -> None:
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    await request.app.state.engine_client.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))


async def _join(request, body: dict) -> dict:
    from prl.inference.protocol import CollectiveJoin

    req = CollectiveJoin.model_validate(body)
    await _init(request, {"kind": "join", **req.model_dump()})
    return {"epoch": req.epoch}


async def _receive(request, cfg, body: dict) -> dict:
    from prl.backends.vllm.staging import read_status, status_dir
    from prl.inference.protocol import CollectiveReceive

    req = CollectiveReceive.model_validate(body)
    await _init(request, {"kind": "receive", "version": req.version, "epoch": req.epoch})
    while True:  # the workers stage on their threads; the engine loop goes on decoding
        status = read_status(status_dir(cfg), req.version)
        if status["state"] == "ready":
            return {"version": req.version}
        if status["state"] == "failed":
            raise RuntimeError(f"v{req.version}: {status['error']}")
        await asyncio.sleep(0.05)


def config():
    from prl.recipe.resolve import load_process_config

    return load_process_config(os.environ["PRL_CONFIG"])

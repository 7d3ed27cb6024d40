"""prl's weight-transfer engine for vLLM, registered through the `vllm.general_plugins` entry point.

vLLM calls `register()` in every one of its processes; a server started with
`--weight-transfer-config '{"backend": "prl"}'` then builds `PrlWeightEngine` in each worker.
The engine reads version N of the run's published weights through prl's `WeightSource` (in
place on the trainer's host, else downloaded from the trainer endpoint and verified), so it
works without a GPU and wherever NCCL is off.

Rules:
- `update_weights {"version": N, "action": "stage"}` starts a thread (`prl.backends.vllm.staging`)
  that fetches, verifies (sizes, sha256) and reads vN into memory, then checks it (checkpoint
  format, every name and shape of the model's checkpoint, finite values), while decoding goes on;
  the client waits for "ready" on `GET /prl/staged` (answered by prl's middleware);
- `{"action": "load"}` (the server is paused) copies the staged tensors in with vLLM's layerwise
  reload (`load_weights`, then each layer's post-processing), so kernels' packed copies follow;
- `{"action": "draft"}` inside vLLM's draft session (`/start_draft_weight_update`: the engine's target
  is the MTP drafter) loads the model folder's MTP layer, FP8 where the serving layout says; the
  client runs it once per server, after the first version, when the server started on dummy weights;
- a worker keeps the version the orchestrator asked to stage and the newest it received
  (`prl.backends.vllm.staging`); the client loads the newest one every worker staged whole;
- a LoRA adapter version (manifest `adapter`: `X.lora_A`, `X.lora_B` with the scale in B) is checked
  against the checkpoint's shapes, merged into a kept copy of its base's target weights
  (`prl.model.lora.AdapterBase`, read once from the base's folder) and loaded as a partial state: the
  targets and their fused siblings (vLLM loads q/k/v into one `qkv_proj`: a layer loaded in part would
  be rebuilt with the rest uninitialised), every other layer keeps its weights. A worker that does not
  hold the base (restarted, or serving another whole version) loads the base whole under the targets;
- anything wrong is raised before a tensor is touched, marked `REJECTED`: vLLM answers the update
  with an error and the old version keeps serving; an error after the reload began is not marked
  (the client then keeps the server paused: a half-loaded model is never served).

This module imports vLLM; nothing else in prl does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from prl.backends.vllm.rejected import REJECTED
from prl.model.weights import StreamedOnly, nonfinite_names

BACKEND = "prl"
REPACK_VERSIONS = ("0.32.",)  # vLLM versions whose CPU reload needs `repack_cpu_experts`
CONFIG_ENV = "PRL_CONFIG"  # the server's ProcessConfig (set by prl's launcher)


@dataclass
class PrlInitInfo(WeightTransferInitInfo):
    """Empty at start. The collective weight path (`prl.backends.vllm.collective`) sends `kind` "join"
    (the trainer's group: this server's first rank, its epoch) and "receive" (stage `version` off it)."""

    kind: str = ""
    addr: str = ""
    port: int = 0
    world: int = 0
    rank: int = 0
    epoch: int = 0
    timeout_s: float = 120.0
    backend: str = "gloo"
    senders: int = 1
    version: int = -1


@dataclass
class PrlUpdateInfo(WeightTransferUpdateInfo):
    version: int
    action: str = "load"  # "stage" | "load"


class Merged(dict):
    """A LoRA adapter version as the weights it makes (`W_base + B' @ A` per target, fused siblings from the
    base): `base` the version it applies to, `targets` the weights the adapter changed, `whole` whether it
    holds every tensor of the checkpoint (completed with the base) or only those (a partial load)."""

    def __init__(self, tensors: dict, base: int, targets: set[str], whole: bool = False):
        super().__init__(tensors)
        self.base, self.targets, self.whole = base, targets, whole


class PrlWeightEngine(WeightTransferEngine[PrlInitInfo, PrlUpdateInfo]):
    init_info_cls = PrlInitInfo
    update_info_cls = PrlUpdateInfo
    supports_draft_weight_update = True  # MTP on dummy-started servers: the folder's draft layer (`draft`)

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        from prl.recipe.resolve import load_process_config
        from prl.transport.weights import weight_source

        if CONFIG_ENV not in os.environ:
            raise RuntimeError(f"the prl weight-transfer engine needs {CONFIG_ENV} (start vLLM through prl)")
        from prl.backends.vllm.staging import Stager, status_dir

        self.cfg = load_process_config(os.environ[CONFIG_ENV])
        self.source = weight_source(self.cfg)
        self._expected: dict[str, tuple[int, ...]] | None = None
        self.rank, world = worker_rank()
        self.wire = None  # the collective weight path's group, once joined
        dp_index = getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0
        self.member = dp_index * world + self.rank  # its place among the server's receiving workers
        dp = getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1
        # one status file per worker of the server (every replica's): "ready" means all of them staged
        self.stager = Stager(self.read, status_dir(self.cfg), self.member, world * dp)
        self.loaded: int | None = None  # the version this worker serves (set by a load)
        from prl.model.lora import AdapterBase

        self.adapter_base = AdapterBase(self.source.fetch)  # LoRA: the base's target weights, read once
        self.merge_lock = threading.Lock()  # staging threads share it
        self.holds_base: int | None = None  # the whole version this worker's weights are, adapters' targets aside
        self.merged: set[str] = set()  # the target weights an adapter changed on this worker

    def init_transfer_engine(self, init_info: PrlInitInfo) -> None:
        """Runs in vLLM's engine loop: a join waits for the group to form (the trainer and every server
        join at once); a receive only starts the staging thread."""
        from prl.backends.vllm.collective import join, receive_read

        if init_info.kind == "join":
            self.wire = join(init_info, self.member, self.device)
        elif init_info.kind == "receive":
            if self.wire is None or self.wire.info.epoch != init_info.epoch:
                raise ValueError(f"{REJECTED}: not a member of weight group epoch {init_info.epoch}; form it anew")
            self.stager.start(init_info.version, read=receive_read(self, self.wire))
        elif init_info.kind:
            raise ValueError(f"init_info.kind = {init_info.kind!r}: expected 'join' or 'receive'")

    def start_weight_update(self) -> None:
        pass  # the reload runs whole inside the load, after the version was verified

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def receive_weights(self, info: PrlUpdateInfo) -> None:
        """`stage` starts reading vN on a thread and returns (decoding goes on); `load` waits for it,
        then copies it in (the server is paused)."""
        try:
            if info.action not in ("stage", "load", "draft"):
                raise ValueError(f"update_info.action = {info.action!r}: expected 'stage', 'load' or 'draft'")
            if info.action != "draft" and info.version == self.loaded and not self.stager.holds(info.version):
                self.stager.already(info.version)  # served already (e.g. asked again by a restarted orchestrator)
                return
            if info.action == "stage":
                self.stager.start(info.version, pin=True)
                return
            state = self.draft() if info.action == "draft" else self.completed(self.stager.result(info.version))
        except StreamedOnly as e:  # not a bad version: this worker missed the stream (the client takes it out)
            raise ValueError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - every refusal before touching the model is marked
            raise ValueError(f"{REJECTED}: {type(e).__name__}: {e}") from None
        self.load(state)
        if info.action != "draft":
            self.loaded = info.version
            merged = isinstance(state, Merged)
            self.holds_base = state.base if merged else info.version
            self.merged = state.targets if merged else set()

    def draft(self) -> dict[str, torch.Tensor]:
        """`draft` (in vLLM's draft session, `self.model` is the drafter): the model folder's MTP layer,
        FP8 where the serving layout says (`prl.model.mtp_weights.draft_state`), checked before loading."""
        from prl.model.mtp_weights import draft_state

        state = draft_state(self.cfg.model_dir)
        if not state:
            raise ValueError(f"{self.cfg.model_dir}: no MTP layer tensors for the drafter")
        nonfinite = nonfinite_names(state)
        if nonfinite:
            raise ValueError(f"{self.cfg.model_dir}: non-finite values in {nonfinite[:5]}")
        return state

    def read(self, version: int) -> dict[str, torch.Tensor]:
        from prl.model.weights import read_weights

        path = self.source.fetch(version)
        state, manifest = read_weights(Path(path))
        if manifest.get("version") != version:
            raise ValueError(f"{path} holds v{manifest.get('version')}, not v{version}")
        if manifest.get("format") != "hf":
            raise ValueError(f"{path}: not published in Hugging Face checkpoint format (trainer not set up for vLLM)")
        return self.staged(path, state, manifest)

    def staged(self, where, state: dict[str, torch.Tensor], meta: dict, expected: dict | None = None) -> dict:
        """A version as received, checked: a whole one against `expected` (default: the checkpoint); a LoRA
        adapter version merged into its base (`Merged`)."""
        from prl.model.policy import Version

        form = Version.of(meta)  # what the version holds: every weight, or adapters over a base
        if not form.adapters:
            self.check(where, state, expected)
            return state
        return self.completed(self.merge(where, state, form, expected))

    def merge(self, where, adapter: dict[str, torch.Tensor], form, expected: dict | None = None) -> Merged:
        """An adapter version (`form`, a `prl.model.policy.Version`) checked (known targets, paired, shapes,
        finite) and merged into its base's target weights, with the base's values of their fused siblings; the
        result checked against the checkpoint's shapes of those weights."""
        expected = expected if expected is not None else self.expected()
        problems = form.refusal(adapter, expected)
        if problems:
            raise ValueError(f"{where}: adapter refused: {'; '.join(problems[:3])}")
        with self.merge_lock:
            state = form.merge(adapter, self.adapter_base)
            siblings = fused_siblings(set(state), expected, packed_modules(self.model)) - set(state)
            state.update(self.adapter_base.targets(form.base, siblings))
        self.check(where, state, {k: expected[k] for k in state})
        return Merged(state, form.base, form.targets(adapter))

    def completed(self, state: dict) -> dict:
        """What loading `state` takes on this worker: a partial adapter state over the base it holds (with
        the base's values of targets an earlier adapter changed and this one does not), else the base
        whole under the merged targets (a restarted worker, or one that serves another whole version)."""
        if not isinstance(state, Merged) or state.whole:
            return state
        if self.holds_base != state.base:
            whole = self.read(state.base)
            if isinstance(whole, Merged):
                raise ValueError(f"v{state.base}, an adapter's base, is an adapter version itself")
            return Merged({**whole, **state}, state.base, state.targets, whole=True)
        restore = self.merged - set(state)
        if not restore:
            return state
        with self.merge_lock:
            old = self.adapter_base.targets(state.base, restore)
        return Merged({**old, **state}, state.base, state.targets)

    def check(self, path, state: dict[str, torch.Tensor], expected: dict | None = None) -> None:
        """`state` holds exactly `expected` (default: the whole checkpoint), shapes included, all finite."""
        expected = expected if expected is not None else self.expected()
        missing = sorted(set(expected) - set(state))
        extra = sorted(set(state) - set(expected))
        bad = sorted(k for k in expected.keys() & state.keys() if tuple(state[k].shape) != expected[k])
        if missing or extra or bad:
            raise ValueError(f"{path}: does not match the served model: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}, wrong shape {bad[:5]}")
        nonfinite = nonfinite_names(state)
        if nonfinite:
            raise ValueError(f"{path}: non-finite values in {nonfinite[:5]}")

    def expected(self) -> dict[str, tuple[int, ...]]:
        if self._expected is None:
            from prl.model.hf_format import checkpoint_shapes

            self._expected = checkpoint_shapes(self.cfg.model_dir)
        return self._expected

    def expected_share(self) -> dict[str, tuple[int, ...]]:
        """What this worker takes from the collective stream: the checkpoint less the experts it does not
        serve under expert parallelism (its model's own expert map)."""
        from prl.transport.collective import EXPERT

        from prl.backends.vllm.collective import logical, routed_experts

        local = local_experts(self.model)
        if local is None:
            return self.expected()
        experts = routed_experts(self.cfg)
        local = {logical(p, experts) for p in local} if experts else local  # physical slots (EPLB) -> experts
        return {k: v for k, v in self.expected().items() if (m := EXPERT.search(k)) is None or int(m.group(1)) in local}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """vLLM's layerwise reload. A partial state (a LoRA adapter's targets) loads the layers it holds
        whole; the reload puts every layer that got no weights back as it was (vLLM warns for each: quiet
        here), and only MoE layers that got weights are re-packed (a packed layer must not be packed twice)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        partial = isinstance(state, Merged) and not state.whole
        initialize_layerwise_reload(self.model)
        with quiet_untouched_layers() if partial else contextlib.nullcontext():
            self.model.load_weights(iter(state.items()))
            finalize_layerwise_reload(self.model, self.model_config)
        repack_cpu_experts(self.model, set(state) if partial else None)


def packed_modules(model) -> dict[str, list[str]]:
    """vLLM's fused layers of `model`: fused name -> the checkpoint modules loaded into it (q/k/v -> qkv_proj)."""
    return dict(getattr(model, "packed_modules_mapping", None) or {})


def fused_siblings(names: set[str], expected: dict, packed: dict[str, list[str]]) -> set[str]:
    """Every checkpoint tensor (weights, biases) of the modules vLLM loads into the same layer as one of `names`."""
    groups = [tuple(g) for g in packed.values()]
    stems = set()
    for name in names:
        parent, _, leaf = name.rsplit(".", 1)[0].rpartition(".")
        stems |= {f"{parent}.{m}" for m in next((g for g in groups if leaf in g), (leaf,))}
    return {k for k in expected if k.rsplit(".", 1)[0] in stems}


@contextlib.contextmanager
def quiet_untouched_layers():
    """Drops vLLM's "Failed to load weights" warning of its layerwise reload (one per layer a partial load
    leaves as it was) while the block runs."""
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")

    def keep(record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()

    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


def local_experts(model) -> set[int] | None:
    """The global physical slots this worker serves (its MoE layers' expert map), None: all of them."""
    for module in model.modules():
        manager = getattr(module, "expert_map_manager", None)
        if manager is not None and manager.use_ep:
            return set(manager.get_local_expert_ids())
    return None


def worker_rank() -> tuple[int, int]:
    """This worker's place among the server's tensor-parallel workers (each stages its own copy)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def repack_cpu_experts(model, loaded: set[str] | None = None) -> int:
    """vLLM 0.32 on CPU: a weight update leaves MoE expert weights unpacked.

    At startup the CPU experts kernel prepacks `w13_weight`/`w2_weight` into its grouped-GEMM layout
    (`fused_experts.process_weights_after_loading`); on a reload, the unquantized MoE method copies
    the new raw weights into the same storage but runs that hook only on the first load, so the
    kernel then reads raw weights as if packed (wrong outputs, found by prl's logprob test). Re-run
    the hook after every reload on CPU; a MoE layer of an unknown shape fails loudly. `loaded`: the
    names a partial load held; only MoE layers with a weight among them are re-packed (None: all)."""
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    moe = [(n, m) for n, m in model.named_modules() if hasattr(m, "w13_weight")
           and (loaded is None or any(k.startswith(n + ".") for k in loaded))]
    if moe and not vllm.__version__.startswith(REPACK_VERSIONS):
        raise RuntimeError(f"prl's CPU expert re-pack after a weight update is written for vLLM {REPACK_VERSIONS}, "
                           f"this is {vllm.__version__}: check whether its reload still leaves experts unpacked "
                           f"(tests/test_vllm.py) and update prl.backends.vllm.plugin")
    for name, module in moe:
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None:
            raise RuntimeError(f"{name}: MoE layer without quant_method.moe_kernel.fused_experts; prl cannot "
                               f"re-pack its experts after a weight update")
        keep = {k: getattr(module, k) for k in ("w13_weight", "w2_weight")}
        experts.process_weights_after_loading(module)
        for k, param in keep.items():  # packed values into the original storage: compiled graphs hold it
            packed = getattr(module, k)
            if packed is not param:
                if packed.shape != param.shape:
                    raise RuntimeError(f"{name}.{k}: packing changed the shape {tuple(param.shape)} -> "
                                       f"{tuple(packed.shape)}; prl cannot keep the storage")
                param.data.copy_(packed.data)
                setattr(module, k, param)
    return len(moe)


def register() -> None:
    """The `vllm.general_plugins` entry point: make `--weight-transfer-config '{"backend": "prl"}'` known."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "PrlWeightEngine")
    except ValueError:  # already registered in this process
        pass

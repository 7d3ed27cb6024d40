"""vLLM's model for a served folder, built on CPU and fed a published weights version through its own
`load_weights`, for tests/test_vllm_fp8.py:

    python tests/vllm_fp8_rig.py MODEL_DIR WEIGHTS_DIR OUT.pt

A child process: vLLM's config, distributed state and custom ops are process-wide. The model is built as
vLLM's loader builds it (its config from the folder, whose `quantization_config` makes the FP8 layers);
where this CPU has no vLLM FP8 kernel (no AMX), kernel selection is stubbed: the weights are only created
and loaded here, never multiplied. Saves every parameter as loaded, each module's quant method by module
name, the parameters no published tensor reached, and whether kernels were stubbed.
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch


def fp8_kernels_here() -> bool:
    from vllm import _custom_ops as ops

    return torch.cpu._is_amx_tile_supported() and ops._supports_cpu_fp8_w8a16


def stubbed_kernels(stack: ExitStack) -> None:
    """Kernel choice without a kernel: weight creation and loading do not depend on it."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.quantization import fp8

    stack.enter_context(mock.patch.object(fp8, "init_fp8_linear_kernel", lambda **_: None))
    stack.enter_context(mock.patch.object(fp8, "select_fp8_moe_backend", lambda **_: (Fp8MoeBackend.CPU, None)))


def current_config():
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config()


def build(model_dir: str):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    config = EngineArgs(model=model_dir, dtype="bfloat16", quantization="fp8", load_format="dummy",
                        enforce_eager=True, max_model_len=256, skip_tokenizer_init=True).create_engine_config()
    stack = ExitStack()
    stack.enter_context(set_current_vllm_config(config))
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tempfile.mkdtemp()}/rendezvous")
    initialize_model_parallel(1, 1)
    return initialize_model(vllm_config=config), stack


def main(model_dir: str, weights_dir: str, out: str) -> None:
    from prl.model.weights import read_weights

    state, _ = read_weights(Path(weights_dir))
    with ExitStack() as stack:
        stubbed = os.environ.get("PRL_FP8_RIG_STUB") == "1" or not fp8_kernels_here()  # the env: to try the stubs
        if stubbed:
            stubbed_kernels(stack)
        model, config_scope = build(model_dir)
        stack.enter_context(config_scope)
        loaded = model.load_weights(iter(state.items()))
    params = dict(model.named_parameters())
    methods = {name: type(m.quant_method).__name__ for name, m in model.named_modules()
               if getattr(m, "quant_method", None) is not None}
    torch.save({"params": {k: v.detach().clone() for k, v in params.items()}, "methods": methods,
                "unloaded": sorted(set(params) - set(loaded)), "stubbed": stubbed}, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])

"""The trainer's lean forward: the model's own modules, none of transformers' per-call machinery.

The engine's lean forward (`prl.model.lean_forward`) showed where a small model's forward goes:
the causal-mask builder, output classes, keyword plumbing through decorators, RMSNorm as seven ops.
The trainer's forward pays the same, and its backward pays again for every op the forward recorded.
`install(model)` swaps the model's class and its decoder layers' classes for subclasses whose forward
runs the same math through the same layer functions the engine uses (`qwen3_moe_layer`,
`glm_moe_dsa_layer`), with gradients and without a cache; state-dict keys do not change.

Why the classes and not a function beside the model: the trainer reaches the model through
`model(...)` and each decoder layer through `layer(...)`, and those calls are where FSDP2 gathers
and frees a unit's parameters (its hooks), where activation checkpointing recomputes a layer
(transformers' `GradientCheckpointingLayer.__call__`) and where the chunked logprob head takes over
(`prl.trainer.head`). Inside a layer the leaf modules are called as they are, so what prl swapped
into them stays: R3's replay routers, FP8 linears and experts, LoRA's linears, expert parallelism's
experts, the stable DSA indexer, context parallelism's attention.

The mask is the block-causal mask of the packed rows (`prl.transport.trees.tree_mask`: each token sees
the earlier tokens of its own sample, of its own branch and its tree's root), the mask transformers
derives from the position ids (or the tree mask the trainer passes). Under context parallelism
GLM-5's attention adapter makes its own (`prl.trainer.context_parallel`) and none is built. Where the
lean forward does not fit (`prl.model.lean_forward.fits`: a family without one, sliding windows, an
attention implementation other than sdpa or eager) or a call is not a training forward (a cache,
embeddings given), the model's forward runs. `trainer.lean_forward = false` keeps the model's forward.
"""

from __future__ import annotations

import torch

from prl.model import lean_forward as lf
from prl.trainer import two_batch
from prl.transport.trees import tree_mask


def install(model, cp: bool = False, parts: int = 0) -> bool:
    """Swap `model` (before FSDP wraps it) for the lean forward; False where it does not fit (unchanged).
    `cp`: context parallelism's attention builds its masks, so none is built here; `parts`: MoE layers
    run their micro-batch in that many parts (`prl.trainer.two_batch`; 0: whole)."""
    if not lf.fits(model) or model.config.model_type not in LAYERS:
        return False
    if not isinstance(model, LeanCausalLM):
        model.__class__ = type(f"Lean{type(model).__name__}", (LeanCausalLM, type(model)), {})
    model._prl_masks = not cp
    for layer in model.model.layers:
        if not isinstance(layer, LeanLayer):
            layer.__class__ = type(f"Lean{type(layer).__name__}", (LAYERS[model.config.model_type], type(layer)), {})
        layer._prl_two_batch = parts
    return True


class LeanCausalLM:
    """Mixin placed before the transformers CausalLM class: a training forward (ids and position ids
    of packed rows, no cache) runs lean; any other call, and any call while `_prl_lean` is False, runs
    the model's forward."""

    _prl_lean: bool = True
    _prl_masks: bool = True

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        if (not self._prl_lean or past_key_values is not None or inputs_embeds is not None or use_cache or kwargs
                or position_ids is None or (attention_mask is not None and attention_mask.dim() != 4)):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                                   use_cache=use_cache, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        m = self.model
        h = m.embed_tokens(input_ids)  # [R, W, H]
        mask = self.lean_mask(position_ids, attention_mask, h.dtype) if self._prl_masks else None
        h = type(m.layers[0]).lean_layers(m, h, position_ids, mask)
        return CausalLMOutputWithPast(logits=lf.linear(self.lm_head, lf.rms_norm(m.norm, h)))

    def lean_mask(self, position_ids: torch.Tensor, given: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """[R, 1, W, W]: the rows' mask, bool under sdpa, additive under eager (as transformers' own)."""
        if given is None:
            allowed = tree_mask(position_ids)
        else:  # the tree mask the trainer built (`trees.attention_mask`): bool, or additive under eager
            allowed = given if given.dtype == torch.bool else given == 0
        if self.config._attn_implementation == "sdpa":
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


class LeanLayer:
    """Mixin placed before a transformers decoder layer class: called with positional arguments only (by
    `lean_layers`, which runs the model's layers through their calls: FSDP's hooks, checkpointing) it is the
    family's lean layer; called as the model's forward calls it (keywords), the layer's own forward."""

    _prl_two_batch: int = 0  # parts of a micro-batch each MoE layer runs (`prl.trainer.two_batch`); 0: whole

    def forward(self, h, *args, **kwargs):
        if kwargs:
            return super().forward(h, *args, **kwargs)
        return self.lean(h, *args)


class LeanQwen3MoeLayer(LeanLayer):
    def lean(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if self._prl_two_batch and (out := two_batch.qwen3_moe_layer(self, h, (cos, sin), bias,
                                                                      self._prl_two_batch)) is not None:
            return out
        return lf.qwen3_moe_layer(self, h, (cos, sin), bias)

    @staticmethod
    def lean_layers(m, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        cos, sin = lf.qwen3_rope(m, h, positions)
        if mask.dtype != torch.bool:  # eager: the grouped products add a [R, 1, 1, W, W] bias
            mask = mask[:, :, None]
        for layer in m.layers:
            h = layer(h, cos, sin, mask)
        return h


class LeanGlmMoeDsaLayer(LeanLayer):
    def lean(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                positions: torch.Tensor, topk: torch.Tensor | None):
        if self._prl_two_batch and (out := two_batch.glm_moe_dsa_layer(self, h, (cos, sin), mask, positions, topk,
                                                                        self._prl_two_batch)) is not None:
            return out
        return lf.glm_moe_dsa_layer(self, h, (cos, sin), mask, positions, topk)

    @staticmethod
    def lean_layers(m, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        cos, sin = m.rotary_emb(h, positions)
        topk = None  # a shared DSA layer reuses the previous indexer layer's selection
        for layer in m.layers:
            h, topk = layer(h, cos, sin, mask, positions, topk)
        return h


LAYERS = {"qwen3_moe": LeanQwen3MoeLayer, "glm_moe_dsa": LeanGlmMoeDsaLayer}

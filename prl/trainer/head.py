"""Token logprobs computed in chunks inside the output head: the `[tokens, vocab]` logits never exist.

At GLM-5's vocabulary (154,880) a 131k-token sequence has 20 G logits (81 GB in fp32), more than a
GPU holds, yet each token needs only its target's logprob. `install(model)` swaps the model's
`lm_head` (an `nn.Linear`) for a subclass with the same parameters and state-dict keys; inside
`targets(model, ids_L, temperature, chunk)` its forward returns `[1, L, 1]` logprobs instead of
logits, each chunk of `chunk` tokens computed under activation checkpointing (its logits are
recomputed in backward), so at most one chunk's logits are alive at a time. Because the head runs
inside the model's own forward, FSDP's hooks gather and reduce its weight exactly as before.
Outside the context (or with `chunk = 0`, which keeps one chunk of all tokens) it is the plain
linear layer. With `entropy`, each token also gets the policy's entropy from the same chunk of
logits (`[1, L, 2]`: logprob, entropy); its gradient flows only where the loss uses it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def chunk_logprobs(h_CD: torch.Tensor, weight: torch.Tensor, bias, targets_C: torch.Tensor,
                   temperature: float, entropy: bool = False) -> torch.Tensor:
    logits_CV = F.linear(h_CD, weight, bias).float() / temperature
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    logp_C = logits_CV.gather(-1, targets_C[:, None])[:, 0] - lse_C
    if not entropy:
        return logp_C
    # H = logsumexp(z) - sum softmax(z) z, from the chunk's logits (no other pass over the vocabulary)
    entropy_C = lse_C - (torch.softmax(logits_CV, dim=-1) * logits_CV).sum(-1)
    return torch.stack([logp_C, entropy_C], dim=-1)


class LogprobHead(torch.nn.Linear):
    _prl_targets: tuple[torch.Tensor, float, int, bool] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._prl_targets is None:
            return super().forward(hidden)
        targets_L, temperature, chunk, entropy = self._prl_targets
        h_LD = hidden.reshape(-1, hidden.shape[-1])
        if h_LD.shape[0] != targets_L.shape[0]:
            raise ValueError(f"{h_LD.shape[0]} hidden states for {targets_L.shape[0]} targets")
        step = chunk or h_LD.shape[0]
        parts = [checkpoint(chunk_logprobs, h_LD[s:s + step], self.weight, self.bias, targets_L[s:s + step],
                            temperature, entropy, use_reentrant=False) if chunk else
                 chunk_logprobs(h_LD, self.weight, self.bias, targets_L, temperature, entropy)
                 for s in range(0, h_LD.shape[0], step)]
        return torch.cat(parts).reshape(1, h_LD.shape[0], -1).clone()  # not a view: FSDP hooks the output


def install(model) -> None:
    install_on(model.get_output_embeddings(), type(model).__name__)


def install_on(head: torch.nn.Module, owner: str = "the model") -> None:
    if type(head) is not torch.nn.Linear and not isinstance(head, LogprobHead):
        raise NotImplementedError(f"{owner}: chunked logprobs need an nn.Linear output head, found {type(head).__name__}")
    head.__class__ = LogprobHead


@contextlib.contextmanager
def targets(model, targets_L: torch.Tensor, temperature: float, chunk: int, entropy: bool = False):
    """Within: the model's forward returns logits = `[1, L, 1]` logprobs of `targets_L` (`[1, L, 2]` with
    each token's entropy beside it)."""
    head = model.get_output_embeddings()
    head._prl_targets = (targets_L, temperature, chunk, entropy)
    try:
        yield
    finally:
        head._prl_targets = None

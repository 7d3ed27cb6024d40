"""Shared prompts: a group's members trained over one copy of their prompt.

The n members of a GRPO group share their prompt P. Packed one by one, the trainer runs P's tokens n
times; on reverse-tiny a prompt is about two thirds of a sample. Packed as a tree, a row holds:
- the root: P's first |P|-1 tokens once (positions 0 .. |P|-2, no loss);
- one branch per member: P's last token again, then the member's completion but its last token
  (positions |P|-1 ...), targets and loss as in the member's own stretch (`sample_arrays`).

A branch attends to its root and to its own earlier tokens, never to another branch, so each loss
token gets the logprob it gets in its own stretch, and the gradient is the same sum: the root's
activations receive every branch's gradient, as the n copies of P did together.

The row format gains no field. Where a token's position does not continue the previous token's, a
segment starts: at position 0 a new sample (tree), elsewhere a branch of the current one. The first
branch continues the root (its first position is the root's last + 1), so it shares the root's
segment; every later branch is a segment of its own and sees only the root's tokens below its own
first position. `tree_mask` turns this into the attention mask; a row without branches needs none
(transformers derives the block-diagonal mask from the position ids, as before).
"""

from __future__ import annotations

import torch

# members are `prl.transport.batch.Sample`s (batch imports this module, so it is not imported back)


def tree_tokens(members: list) -> int:
    """The tokens of `members` packed as one tree (one of them: its own stretch)."""
    p = len(members[0].prompt_ids)
    return p - 1 + sum(len(s.completion_ids) for s in members)


def can_share(s) -> bool:
    """A prompt of one token has no root to share (the branch repeats the last prompt token)."""
    return len(s.prompt_ids) >= 2


def prompt_key(s) -> tuple:
    """What members of one tree have in common: the prompt, and its routes where replayed."""
    root = len(s.prompt_ids) - 1
    routes = None if s.routing is None else s.routing[:root].contiguous().numpy().tobytes()
    return tuple(s.prompt_ids), routes


def share_prompts(samples: list, max_tokens: int) -> list[list]:
    """`samples` as packing units: the samples of one prompt (in the order they came) grouped into
    trees of at most `max_tokens` tokens; a sample alone where no other shares its prompt. With R3,
    only samples whose prompts were routed alike share (a multi-turn environment sends each member
    as its own request, perhaps to another server or under another version: the root replays one
    member's routes for all)."""
    by_prompt: dict[tuple, list] = {}
    units: list[list] = []
    for s in samples:
        if not can_share(s):
            units.append([s])
            continue
        by_prompt.setdefault(prompt_key(s), []).append(s)
    for members in by_prompt.values():
        tree: list = []
        for s in members:
            if tree and tree_tokens([*tree, s]) > max_tokens:
                units.append(tree)
                tree = []
            tree.append(s)
        units.append(tree)
    return units


def tree_arrays(members: list, arrays) -> dict[str, list]:
    """The per-token columns of one tree: the first member's root, then each member's branch
    (`arrays` is `batch.sample_arrays`)."""
    root = len(members[0].prompt_ids) - 1
    cols = {k: v[:root] for k, v in arrays(members[0]).items()}
    for s in members:
        for k, v in arrays(s).items():
            cols[k].extend(v[root:])
    return cols


def tree_routing(members: list) -> torch.Tensor:
    """R3: the root's routing from the first member (one prefill computed it for all), each branch's own."""
    root = len(members[0].prompt_ids) - 1
    return torch.cat([members[0].routing[:root], *(s.routing[root:] for s in members)])


def segment_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[..., L] bool: where a segment starts (the first token, and wherever positions do not continue)."""
    prev = torch.cat([position_ids[..., :1] - 1, position_ids[..., :-1]], -1)
    starts = position_ids != prev + 1
    starts[..., 0] = True
    return starts


def sample_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which packed sample (a tree counts as one) each token of a row belongs to: a sample starts where
    its position is 0."""
    return torch.cumsum((position_ids == 0).long(), -1) - 1


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[L]: which segment (a sample, or a branch of a tree past its first) each token belongs to."""
    return torch.cumsum(segment_starts(position_ids).long(), -1) - 1


def has_branches(position_ids: torch.Tensor) -> bool:
    """Whether a row holds a tree: a segment that starts at a position other than 0."""
    starts = segment_starts(position_ids)
    starts[..., 0] = False
    return bool((starts & (position_ids != 0)).any())


def _at_last(flags: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per token, `values` at the latest index at or before it where `flags` holds (index 0 if none)."""
    idx = torch.arange(flags.shape[-1], device=flags.device).expand_as(flags)
    last = torch.cummax(torch.where(flags, idx, torch.zeros_like(idx)), -1).values
    return values.gather(-1, last)


def tree_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[R, 1, W, W] bool (query, key) for rows `position_ids` [R, W]: a key is seen when it is not
    later, in the same sample, and either in the query's segment or in the sample's first segment
    below the query's segment's first position (the root, never another branch)."""
    pos = position_ids
    starts = segment_starts(pos)
    seg = torch.cumsum(starts.long(), -1)
    sample = sample_ids(pos)
    seg_first_pos = _at_last(starts, pos)  # the position where the token's segment starts
    root_seg = _at_last(pos == 0, seg)  # the first segment of the token's sample
    q, k = (lambda t: t[:, :, None]), (lambda t: t[:, None, :])
    W = pos.shape[-1]
    causal = torch.ones(W, W, dtype=torch.bool, device=pos.device).tril()
    own = k(seg) == q(seg)
    root = (k(seg) == q(root_seg)) & (k(pos) < q(seg_first_pos))
    return (causal & (k(sample) == q(sample)) & (own | root))[:, None]


def attention_mask(model, position_ids: torch.Tensor) -> torch.Tensor | None:
    """The mask to pass the model for rows `position_ids` [R, W]: None without trees; with them the
    tree mask, boolean for SDPA, additive for transformers' eager attention."""
    if not has_branches(position_ids):
        return None
    allowed = tree_mask(position_ids)
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl == "sdpa":
        return allowed
    if impl == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    raise ValueError(f"shared-prompt rows need SDPA or eager attention, the model runs {impl!r}: "
                     "set trainer.share_prompts = false")

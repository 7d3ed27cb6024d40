"""A reward model the run serves (`[reward.model]`): a frozen Hugging Face sequence classifier with one label,
scoring sampled conversations over HTTP (`POST /reward`).

Rules:
- the reward model reads text, not the policy's tokens: each conversation is rendered with its own tokenizer (its
  chat template when it has one, the completion as the assistant's message; else the prompt's text followed by the
  completion), so it need not share the policy's vocabulary;
- a conversation longer than `reward.model.max_tokens` is cut from the left (the prompt's start first);
- one forward per request: conversations padded on the right; a decoder's classifier scores each at its own last
  token (causal attention: padding after a sequence changes nothing before it), its head on the final hidden
  state, as transformers pools; an encoder's classifier (BERT-like) runs its own forward with the padding masked;
- a score that is not finite answers 422 (the group is dropped, not retried);
- requests run one at a time on one thread; the weights never change (`/health` answers version 0).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import threading

from fastapi import Depends, FastAPI, HTTPException

from prl.inference.protocol import Health, RewardItem, RewardRequest, RewardResponse
from prl.inference.server import main, new_app, run_app
from prl.tasks.prompts import PromptError, raw_text, render, uses_template
from prl.transport.auth import bearer


class Scorer:
    """The reward model and its tokenizer; `scores` is one batched forward."""

    def __init__(self, model, tokenizer, max_tokens: int):
        self.model, self.tokenizer, self.max_tokens = model.eval(), tokenizer, max_tokens
        self.backbone = getattr(model, model.base_model_prefix)
        self.template = uses_template(tokenizer, "auto")
        self.lock = threading.Lock()

    def ids(self, item: RewardItem) -> list[int]:
        prompt = item.prompt if isinstance(item.prompt, str) else [m.model_dump() for m in item.prompt]
        if self.template:
            msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            ids = render(self.tokenizer, [*msgs, {"role": "assistant", "content": item.completion}], False)
        else:
            ids = self.tokenizer(raw_text(prompt) + item.completion).input_ids
        return ids[-self.max_tokens:]

    def scores(self, seqs: list[list[int]]) -> list[float]:
        """A decoder's classifier (a `score` head): its head on each conversation's last token. Any other (an
        encoder's, pooled at its first token): the model's own forward with the padding masked."""
        import torch

        with self.lock, torch.no_grad():
            lengths = torch.tensor([len(s) for s in seqs])
            x = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
            for i, s in enumerate(seqs):
                x[i, :len(s)] = torch.tensor(s)
            if not hasattr(self.model, "score"):
                mask = torch.arange(x.shape[1])[None] < lengths[:, None]
                return self.model(input_ids=x, attention_mask=mask.long()).logits[:, 0].float().tolist()
            hidden = self.backbone(input_ids=x).last_hidden_state
            last = hidden[torch.arange(len(seqs)), lengths - 1]
            return self.model.score(last)[:, 0].float().tolist()


def create_app(scorer: Scorer, secret: str) -> FastAPI:
    app = new_app("prl reward model")
    guarded = [Depends(bearer(secret))]

    @app.get("/health", dependencies=guarded)
    async def health() -> Health:
        return Health(ok=True, version=0)

    @app.post("/reward", dependencies=guarded)
    async def reward(req: RewardRequest) -> RewardResponse:
        try:
            seqs = [scorer.ids(item) for item in req.items]
        except PromptError as e:
            raise HTTPException(400, str(e)) from None
        if not all(seqs):
            raise HTTPException(400, "a conversation renders to no tokens")
        scores = await asyncio.to_thread(scorer.scores, seqs)
        if not all(map(math.isfinite, scores)):  # a 4xx: the same request would give the same score
            raise HTTPException(422, "the reward model's score is not finite (NaN or infinite) for this conversation")
        return RewardResponse(scores=scores, tokens=sum(map(len, seqs)))

    return app


def serve(cfg, log) -> None:
    import torch

    from prl.model.build import load_tokenizer, torch_dtype
    from prl.model.pretrained import load_pretrained

    rm = cfg.reward_model
    torch.set_num_threads(rm.threads)
    scorer = Scorer(load_pretrained(rm.path, torch_dtype(rm.dtype), head="reward"), load_tokenizer(rm.path), rm.max_tokens)
    run_app(cfg, create_app(scorer, cfg.secret()), f"reward model {rm.path}, {rm.dtype}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m prl.inference.reward_model", description="prl reward-model server")
    parser.add_argument("--config", required=True, help="the resolved process config (JSON) written by `prl run`")
    main(parser.parse_args().config, serve)

"""A tiny reward model fitted to the reverse task's rule reward (edit similarity to the reversed word), for tests and
`bench/reward_model.py`: a Qwen3 sequence classifier over prl's character tokenizer, trained by regression on
completions near and far from the answer."""

from __future__ import annotations

import random
from pathlib import Path

from prl.tasks.builtin import LETTERS

OTHERS = "abcdefghijklmnopqrstuvwxyz0123456789"


def near(answer: str, rng: random.Random) -> str:
    """A completion like a policy's, including what a policy pushing on the reward model writes: the answer, edits
    of it, the word unreversed, the answer with junk after it, its letters repeated or shuffled, other strings; up to
    12 characters (reverse-tiny's sampling.max_tokens)."""
    kind, letters = rng.random(), list(answer)
    if kind < 0.1:
        out = letters
    elif kind < 0.2:
        out = letters[::-1]
    elif kind < 0.3:
        out = [rng.choice(OTHERS) for _ in range(rng.randint(1, 12))]
    elif kind < 0.4:
        out = letters + [rng.choice(LETTERS) for _ in range(rng.randint(1, 6))]
    elif kind < 0.5:
        out = [rng.choice(letters) for _ in range(rng.randint(2, 12))]
    elif kind < 0.6:
        out = rng.sample(letters, len(letters))
    else:
        out = edited(letters, rng)
    return "".join(out)[:12]


def edited(out: list[str], rng: random.Random) -> list[str]:
    out = list(out)
    for _ in range(rng.randint(1, max(1, len(out)))):
        op, i = rng.random(), rng.randrange(len(out) + 1)
        if op < 0.5 and i < len(out):
            out[i] = rng.choice(LETTERS)
        elif op < 0.75 and i < len(out):
            del out[i]
        else:
            out.insert(i, rng.choice(LETTERS))
    return out


def examples(n: int, seed: int, min_len: int = 3, max_len: int = 6) -> list[tuple[str, str, float]]:
    from prl.tasks.builtin import edit_similarity

    rng, out = random.Random(seed), []
    for _ in range(n):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))
        completion = near(word[::-1], rng)
        out.append((f"rev:{word}=", completion, edit_similarity(completion, {"answer": word[::-1]})))
    return out


def fit_reward_model(out: Path, steps: int = 400, seed: int = 0, hidden: int = 64, layers: int = 2,
                     batch: int = 64, lr: float = 3e-3) -> Path:
    """Train and save the reward model (config, weights, the character tokenizer) to `out`; returns `out`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from prl.model.tiny import CHARS, PAD_ID, SPECIALS, char_tokenizer

    torch.manual_seed(seed)
    tok = char_tokenizer()
    config = Qwen3Config(vocab_size=len(SPECIALS) + len(CHARS), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         max_position_embeddings=64, num_labels=1, pad_token_id=PAD_ID, tie_word_embeddings=False)
    model = Qwen3ForSequenceClassification(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    data = examples(steps * batch, seed)
    for step in range(steps):
        rows = data[step * batch:(step + 1) * batch]
        seqs = [tok(p + c).input_ids for p, c, _ in rows]
        lengths = torch.tensor([len(s) for s in seqs])
        x = torch.full((len(seqs), int(lengths.max())), PAD_ID)
        for i, s in enumerate(seqs):
            x[i, :len(s)] = torch.tensor(s)
        hidden_states = model.model(input_ids=x).last_hidden_state
        pred = model.score(hidden_states[torch.arange(len(seqs)), lengths - 1])[:, 0]
        loss = torch.nn.functional.mse_loss(pred, torch.tensor([r for _, _, r in rows]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out

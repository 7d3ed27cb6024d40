"""Tiny models (random init) of the GLM-5 or the Qwen3-MoE architecture, and a character tokenizer
built locally; or a pretrained folder, whose weights are linked in place (never copied).

Nothing is downloaded: the config comes from transformers' `GlmMoeDsaConfig`, the tokenizer from
the `tokenizers` package. `index_topk` defaults above the longest sample, so the DSA indexer runs
but keeps every token; a lower value makes the selection really sparse, and engine and trainer still
keep the same keys (`prl.model.dsa` breaks the indexer's frequent score ties by position).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from prl.recipe.schema import ModelCfg

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789:=+-*, "
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def char_tokenizer():
    """A character-level fast tokenizer (BPE with no merges splits text into characters)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def tiny_config(cfg: ModelCfg, vocab_size: int):
    return {"glm_moe_dsa": glm_config, "qwen3_moe": qwen3_moe_config}[cfg.arch](cfg, vocab_size)


def shared_config(cfg: ModelCfg, vocab_size: int) -> dict:
    """What every tiny family sets alike (transformers names these the same across families)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.dense_dim,
        moe_intermediate_size=cfg.expert_dim,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_experts_per_tok=cfg.experts_per_token,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )


def qwen3_moe_config(cfg: ModelCfg, vocab_size: int):
    """Qwen3-MoE: GQA attention with q/k norms, softmax top-k router, every layer MoE after the
    first `first_dense_layers` (`mlp_only_layers`). vLLM serves this family on CPU."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"],
        **shared_config(cfg, vocab_size),
        mlp_only_layers=list(range(min(cfg.first_dense_layers, cfg.num_layers))),
        num_key_value_heads=max(1, cfg.num_heads // 2),
        head_dim=cfg.head_dim,
        num_experts=cfg.num_experts,
        norm_topk_prob=True,
    )


def glm_config(cfg: ModelCfg, vocab_size: int):
    from transformers import GlmMoeDsaConfig

    head = cfg.head_dim
    return GlmMoeDsaConfig(
        architectures=["GlmMoeDsaForCausalLM"],
        **shared_config(cfg, vocab_size),
        first_k_dense_replace=min(cfg.first_dense_layers, cfg.num_layers),
        num_key_value_heads=cfg.num_heads,
        n_routed_experts=cfg.num_experts,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        kv_lora_rank=max(cfg.hidden_size // 2, 16),
        q_lora_rank=max(cfg.hidden_size * 3 // 4, 16),
        qk_rope_head_dim=head // 2,
        qk_nope_head_dim=head,
        v_head_dim=head,
        index_n_heads=2,
        index_head_dim=head,
        index_topk=cfg.index_topk,
    )


def write_model_dir(cfg: ModelCfg, out: Path) -> Path:
    """The run's model folder, from which every process builds: config.json and the tokenizer, plus
    (pretrained `path`) symlinks to the folder's weight files. Without weights, processes random-init
    with the run's seed."""
    out.mkdir(parents=True, exist_ok=True)
    if cfg.path:
        from prl.model.pretrained import link_pretrained

        return link_pretrained(Path(cfg.path), out)
    cached = cache_dir(cfg)
    if (cached / "config.json").is_file():  # transformers' config classes take seconds to import: same files
        for f in cached.iterdir():
            shutil.copyfile(f, out / f.name)
        return out
    tok = char_tokenizer()
    tok.save_pretrained(out)
    tiny_config(cfg, len(tok)).save_pretrained(out)
    fill_cache(out, cached)
    return out


def cache_dir(cfg: ModelCfg) -> Path:
    """Where the files of this model section are kept once written: keyed by the section, this file's
    code and the transformers and tokenizers versions that wrote them ($XDG_CACHE_HOME/prl/tiny-models)."""
    from importlib.metadata import version

    key = json.dumps([cfg.model_dump(mode="json"), version("transformers"), version("tokenizers"),
                      Path(__file__).read_text()], sort_keys=True)
    root = Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "prl" / "tiny-models"
    return root / hashlib.sha256(key.encode()).hexdigest()[:24]


def fill_cache(written: Path, cached: Path) -> None:
    """Best effort, atomic: a whole folder appears or none (another process may fill it first)."""
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        for f in written.iterdir():
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
        os.rename(tmp, cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)

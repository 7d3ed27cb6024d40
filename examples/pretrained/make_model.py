"""Make a small pretrained-style model folder to train from, with transformers and nothing downloaded:
a Qwen3-MoE config, its (random) weights and a character-level tokenizer, written with
save_pretrained. A real checkpoint's folder (config.json, *.safetensors, the tokenizer files) is used
the same way: point `[model] path` at it.

Usage: python make_model.py [FOLDER]   (default: tiny-qwen3-moe)"""

import sys

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

folder = sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen3-moe"

# a tokenizer with one token per character (a BPE without merges), and the special tokens prl needs
specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
vocab = {token: i for i, token in enumerate(specials + list("abcdefghijklmnopqrstuvwxyz0123456789:=+-*, "))}
core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
core.decoder = decoders.Fuse()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                    eos_token="<eos>", unk_token="<unk>")

config = Qwen3MoeConfig(
    vocab_size=len(vocab), hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(config)
model.save_pretrained(folder)
tokenizer.save_pretrained(folder)
print(f"wrote {folder}: {sum(p.numel() for p in model.parameters()):,} parameters")

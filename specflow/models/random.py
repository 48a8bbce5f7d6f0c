"""Random-weight Llama checkpoints made on the machine (tests, benchmarks, the first demo).

The tokenizer is a byte-level BPE trained on the running Python's standard-library sources,
which every machine has, so text in / text out works with no download.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

EOS = "<|endoftext|>"


def stdlib_files(limit: int | None = None) -> list[Path]:
    """Top-level ``.py`` files of the standard library, sorted by name (deterministic)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return files[:limit] if limit else files


def train_bpe_tokenizer(out: str | Path, vocab_size: int, files: list[Path] | None = None):
    """Train a byte-level BPE on ``files`` (default: 60 stdlib modules) and save it in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    files = files or stdlib_files(60)
    tok.train([str(f) for f in files], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(str(out))
    return fast


def make_random_checkpoint(out: str | Path, *, hidden_size: int = 256, num_layers: int = 4,
                           num_heads: int | None = None, num_kv_heads: int | None = None,
                           intermediate_size: int | None = None, vocab_size: int = 4096,
                           max_position_embeddings: int = 4096, initializer_range: float = 0.02,
                           seed: int = 0, dtype: torch.dtype = torch.float32, tokenizer: bool = True) -> Path:
    """Write a Hugging Face Llama checkpoint with random weights (and a BPE tokenizer) to ``out``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    eos_id = 0
    if tokenizer:
        eos_id = train_bpe_tokenizer(out, vocab_size).convert_tokens_to_ids(EOS)
    num_heads = num_heads or max(1, hidden_size // 64)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        max_position_embeddings=max_position_embeddings, bos_token_id=eos_id, eos_token_id=eos_id,
        initializer_range=initializer_range, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # (a "Writing model shards" bar for every test model, otherwise)
    try:
        model.save_pretrained(str(out))
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    return out

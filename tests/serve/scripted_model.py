"""A Llama checkpoint whose greedy output a test writes down: a next-token table in real weights.

Each script is a trigger and the pieces the model says after it, then EOS. Every trigger and
piece is an added token of the tokenizer (so a piece decodes to exactly its text), and the
weights make the next token a function of the current one: attention and MLP outputs are zero,
so the residual stream is the current token's embedding, a one-hot vector; ``lm_head`` maps it
to the next token's logit. Tokens outside the scripts all share one vector, whose next token is
EOS. The server runs this checkpoint like any other, so its responses carry the text the
engine really generated.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

HIDDEN = 64      # one one-hot dimension per scripted token, plus dimension 0 for all other tokens
LOGIT = 10.0     # x 8 (RMSNorm of a one-hot vector in 64 dims): the next token leads by 80 nats


def make_scripted_checkpoint(out: Path, tokenizer_dir: Path, scripts: dict[str, list[str]],
                             chat_template: str) -> Path:
    """Write to ``out`` a checkpoint that, after the token ``trigger``, greedily says ``pieces`` and
    then EOS, for each ``trigger: pieces`` of ``scripts`` (all distinct strings); the tokenizer is
    ``tokenizer_dir``'s plus these tokens and ``chat_template``."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    chains = [[trigger, *pieces] for trigger, pieces in scripts.items()]
    words = [w for chain in chains for w in chain]
    assert len(set(words)) == len(words) < HIDDEN, "every trigger and piece is its own token"
    tokenizer.add_tokens([AddedToken(w, normalized=False, special=False) for w in words])
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out)
    eos = tokenizer.eos_token_id
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=HIDDEN,
                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                         max_position_embeddings=1024, bos_token_id=eos, eos_token_id=eos,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if "norm" in name else 0.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight   # [V, H] each
        embed[:, 0] = 1.0
        head[eos, 0] = LOGIT
        dim = 1
        for chain in chains:
            ids = [tokenizer.convert_tokens_to_ids(w) for w in chain]
            for token, next_token in zip(ids, [*ids[1:], eos]):
                embed[token] = 0.0
                embed[token, dim] = 1.0
                head[next_token, dim] = LOGIT
                dim += 1
    model.save_pretrained(out)
    return out

"""Tokens' raw bytes and text offsets for OpenAI's logprobs, on a byte-level BPE tokenizer (the
shipped family's) and a SentencePiece-style one with byte fallback."""

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specflow.serve.token_bytes import TextOffsets, TokenBytes

ZOO = Path(__file__).resolve().parents[2] / "zoo" / "tiny-code" / "target"
TEXT = "héllo ά 日本"  # characters of 2 and 3 UTF-8 bytes, which this tokenizer splits


def test_byte_level_tokens_give_their_bytes_and_where_they_start():
    tokenizer = AutoTokenizer.from_pretrained(ZOO)
    ids = tokenizer.encode(TEXT)
    assert "\ufffd" in tokenizer.decode(ids[1:2])            # a token holding half of "é"
    token_bytes = TokenBytes(tokenizer)
    assert token_bytes.byte_level
    assert b"".join(bytes(token_bytes(i)) for i in ids) == TEXT.encode()
    offsets = TextOffsets(token_bytes)
    starts = [offsets(i) for i in ids]
    # each token's offset is the character its first byte belongs to
    byte_chars = [c for c in TEXT for _ in c.encode()]          # the character of every byte
    first_bytes = [sum(len(token_bytes(i)) for i in ids[:k]) for k in range(len(ids))]
    assert [TEXT[s] for s in starts] == [byte_chars[b] for b in first_bytes]
    assert starts == sorted(starts) and starts[-1] < len(TEXT)
    eos = tokenizer.eos_token_id                                # left out of the text: no room
    assert offsets(eos) == offsets(ids[0]) == len(TEXT)


def test_byte_level_added_tokens_are_their_own_text():
    """GPT-2's decoder turns a piece with a character outside its table into that piece's own
    text, "▁" included: DeepSeek's <｜tool▁calls▁begin｜> and <｜end▁of▁sentence｜> are such tokens."""
    tokenizer = AutoTokenizer.from_pretrained(ZOO)
    added = ["<｜tool▁calls▁begin｜>", "😀", "a b"]
    tokenizer.add_tokens([AddedToken(w, normalized=False, special=False) for w in added])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<｜end▁of▁sentence｜>"]})
    token_bytes = TokenBytes(tokenizer)
    for word in [*added, "<｜end▁of▁sentence｜>"]:
        token_id = tokenizer.convert_tokens_to_ids(word)
        assert bytes(token_bytes(token_id)) == tokenizer.decode([token_id]).encode() == word.encode(), word


def test_sentencepiece_pieces_and_byte_fallback():
    vocab = {"<unk>": 0, "<0x0A>": 1, "<0xC3>": 2, "<0xA9>": 3, "▁the": 4, "x": 5}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    token_bytes = TokenBytes(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>"))
    assert not token_bytes.byte_level
    assert [token_bytes(i) for i in (1, 2, 3, 4, 5)] == [[0x0A], [0xC3], [0xA9], list(b" the"), [ord("x")]]

"""A token's raw bytes, which OpenAI's logprobs report so that a client can rebuild the characters
that tokens split (a token's decoded text is then "\ufffd", whose bytes say nothing).

Byte-level BPE pieces (GPT-2, Llama-3, the shipped family) map back through GPT-2's table of
bytes to printable characters; SentencePiece pieces are their text with ``▁`` for a space, and
its byte-fallback pieces ``<0xNN>`` are one byte.
"""

from __future__ import annotations

import codecs
import json
import re


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's table, inverted: printable bytes stand for themselves, the other 68 for the
    characters from U+0100 up, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


BYTE_LEVEL = _byte_level_chars()
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """``token_bytes(token_id)`` -> the token's bytes as a list of ints, cached per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
        self.byte_level = "ByteLevel" in json.dumps(decoder)  # (a Sequence of decoders may hold it)
        self.special = set(tokenizer.all_special_ids)  # left out of a completion's text
        self._cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> list[int]:
        if token_id not in self._cache:
            self._cache[token_id] = list(self._bytes(self.tokenizer.convert_ids_to_tokens(token_id)))
        return self._cache[token_id]

    def _bytes(self, piece: str) -> bytes:
        if self.byte_level:  # as tokenizers' ByteLevel decoder: a piece with a character outside the table
            # is its own text (an added token such as DeepSeek's <｜tool▁calls▁begin｜> keeps its "▁")
            return bytes(BYTE_LEVEL[c] for c in piece) if all(c in BYTE_LEVEL for c in piece) else piece.encode()
        if m := BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return piece.replace("▁", " ").encode()


class TextOffsets:
    """``offsets(token_id)`` -> the character offset in the completion's text where each next
    token starts: where its first byte falls (a token that starts mid-character gets that
    character's offset; special tokens, which the text leaves out, take no room, but in an
    echoed text prompt, which keeps them as sent)."""

    def __init__(self, token_bytes: TokenBytes):
        self.token_bytes, self.chars = token_bytes, 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, token_id: int, shown: bool = False) -> int:
        """``shown``: the text holds this token's own text even when it is a special token (an
        echoed text prompt that wrote one, as sent)."""
        offset = self.chars
        if shown or token_id not in self.token_bytes.special:
            self.chars += len(self._decoder.decode(bytes(self.token_bytes(token_id))))
        return offset

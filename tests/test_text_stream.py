"""TextStream: a running request's text, streamed token by token, is always a prefix of the final
text and equals it at the end (byte-level BPE and SentencePiece-style byte fallback)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specflow.request import Request, TextStream
from specflow.sampling import SamplingParams

ALPHABET = "ab é日本\n:(ö)"


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: Metaspace pieces, byte fallback, the leading space stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "▁a", "b", "▁b", "ab", "é", "▁é", "日", ":", "("]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


TOKENIZERS = {"byte-level": lambda: AutoTokenizer.from_pretrained("zoo/tiny-code/target"),
              "sentencepiece": sentencepiece_like}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]()


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=ALPHABET, min_size=1, max_size=40))
def test_streamed_text_is_a_prefix_of_the_decode_and_ends_equal(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    final = tokenizer.decode(ids, skip_special_tokens=True)
    stream = TextStream(tokenizer)
    for i, token in enumerate(ids):  # never text the final decode takes back (a prefix's own
        stream.add(token)            # decode may: byte fallback turns an unfinished character into U+FFFD)
        assert final.startswith(stream.text(ids[:i + 1]))
    assert stream.text(ids) == final
    assert stream._stream is not None, "a fast tokenizer streams"


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=ALPHABET + "🙂€", min_size=1, max_size=60))
def test_exact_text_is_the_decode_at_every_token(tokenizer, text):
    """``exact`` (stop strings read it) equals a full decode after every token, also while the
    stream holds back an unfinished character, which it decodes from its last clean point only."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer)
    for i, token in enumerate(ids):
        stream.add(token)
        assert stream.exact(ids[:i + 1]) == tokenizer.decode(ids[:i + 1], skip_special_tokens=True)


def test_exact_decodes_a_held_back_tail_only(tokenizer, monkeypatch):
    """While a long output's last character is unfinished, ``exact`` decodes a few tokens, not
    the whole output."""
    ids = tokenizer.encode("ab " * 200 + "日", add_special_tokens=False)
    stream = TextStream(tokenizer)
    for token in ids[:-1]:
        stream.add(token)
    decoded = []
    decode = stream.decode
    monkeypatch.setattr(stream, "decode", lambda part: decoded.append(len(part)) or decode(part))
    text = stream.exact(ids[:-1])
    assert text == tokenizer.decode(ids[:-1], skip_special_tokens=True)
    if stream._holding:  # (a byte-level "日" takes several tokens; byte fallback three)
        assert decoded and max(decoded) < 10


def test_tokenizers_that_clean_up_spaces_decode_in_full():
    tokenizer = sentencepiece_like()
    tokenizer.clean_up_tokenization_spaces = True
    stream = TextStream(tokenizer)
    ids = tokenizer.encode("a (b", add_special_tokens=False)
    for token in ids:
        stream.add(token)
    assert stream._stream is None and stream.text(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_in_a_token_that_ends_inside_a_character():
    """A token carrying whole characters and the first byte of another ("a" + 0xC3): the stream
    holds its text back, and the stop string "a" still stops at that token."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["aÃ"] = len(vocab)  # byte-level: "Ã" is the byte 0xC3, the first of "é"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "Ã")]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    ids = [vocab["aÃ"], vocab["©"], vocab["x"]]
    assert tokenizer.decode(ids) == "aéx"
    req = Request(0, [1], SamplingParams(stop=["a"], max_tokens=10), [], tokenizer)
    assert req.append(ids) == 1 and req.finished
    assert req.output().text == "" and req.output().token_ids == ids[:1]


def test_stop_strings_completed_by_the_same_token_cut_the_text_before_the_first_to_begin():
    """When one token completes two stop strings at once ("ab" and "xab" at the "b" of "zxab"),
    the text ends before the match that begins first, whatever the order of ``stop`` (vLLM cuts at
    the first stop string in list order that matches)."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    ids = [vocab[c] for c in "zxab"]
    for stop in (["ab", "xab"], ["xab", "ab"]):
        req = Request(0, [1], SamplingParams(stop=stop, max_tokens=10), [], tokenizer)
        assert req.append(ids + [vocab["q"]]) == 4 and req.finished and req.finish_reason == "stop"
        assert req.output().text == "z" and req.output().token_ids == ids

"""A request's life: committed tokens, stop checks, and what the caller gets back."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

import numpy as np
import torch
from tokenizers.decoders import DecodeStream

from specflow.logprobs import TokenLogprob
from specflow.sampling import SamplingParams
from specflow.uniforms import make_generator, request_seed, salted_seeds
from specflow.tree import StepRecord


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What ``SpecEngine.generate`` returns per prompt."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]            # generated ids only
    text: str | None                # None when the target has no tokenizer
    finish_reason: str | None       # "stop" (EOS / stop string / stop token) or "length"
    accept_lengths: list[int]       # tokens committed by each step (accepted drafts + bonus)
    # each step's tried depth: its deepest draft the verifier tested on the accepted path (the
    # accepted drafts, + 1 where the last accepted node had children; 0: nothing drafted)
    tried_depths: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token id when SamplingParams.logprobs is set
    # one per prompt token when SamplingParams.prompt_logprobs is set (None for the first)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0      # prompt tokens whose K/V came from the prefix cache

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))


class TextStream:
    """The text of a request's output ids as they are committed, as
    ``tokenizer.decode(ids, skip_special_tokens=True)`` gives it.

    With a fast tokenizer, tokenizers' ``DecodeStream`` adds each token's new characters, so
    streaming a running request's text and checking its stop strings cost O(new tokens) a step,
    not a decode of the whole output. Bytes of a character not yet complete are held back; while
    they are, stop strings check a full decode (``exact``), as finished requests get one. Other
    tokenizers (or ones that clean up spaces after decoding) decode the whole output each time.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        streams = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._backend = backend if streams else None
        self._stream = DecodeStream(skip_special_tokens=True) if streams else None
        self._text = ""
        self._holding = False  # the last token's text is held back (it ends inside a character)
        # tokens added, and the last two counts at which the stream held nothing back (its text
        # then is the exact decode of that many ids): a held-back tail decodes from there
        self._added = self._stable = self._prev_stable = 0

    def add(self, token_id: int) -> None:
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id)
            self._added += 1
            self._holding = piece is None
            if piece is not None:
                self._text += piece
                self._prev_stable, self._stable = self._stable, self._added

    def text(self, ids: list[int]) -> str:
        """The text of ``ids``, every token so far ``add``-ed (held-back characters left out)."""
        return self._text if self._stream is not None else self.decode(ids)

    def exact(self, ids: list[int]) -> str:
        """``decode(ids)``: the streamed text, or while the stream holds back a token (whose text
        may begin with whole characters, before the unfinished one) the streamed text and the
        decode of the held-back tail: the ids from the stream's last point without a held-back
        token, decoded after the ids since the point before it (whose first token a decoder may
        treat as a first one: a leading space stripped), as the stream itself decodes. O(the
        tail), not a decode of the whole output."""
        if self._stream is None:
            return self.decode(ids)
        if not self._holding:
            return self._text
        start, stable = self._prev_stable, self._stable
        if not start:  # (fewer than two clean points yet: a full decode, as before)
            return self.decode(ids)
        head, full = self.decode(ids[start:stable]), self.decode(ids[start:])
        return self._text + full[len(head):] if full.startswith(head) else self.decode(ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class Request:
    """Engine-side state of one request. ``seq`` holds prompt + generated ids; the KV cache
    holds all of them but the last (the root of the next tree). With a tokenizer, the output's
    text is kept as tokens are committed (stop strings, streaming)."""

    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams,
                 eos_token_ids: list[int], tokenizer=None, salt: int = 0):
        self.id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.seed = request_seed(params.seed)  # keys the target's draws (SamplingBatch)
        # keys its coin walks and sampled drafts apart from other requests of its seed (0: not)
        self.salt = salt
        draft_seed = salted_seeds(np.array([self.seed % 2**64], dtype=np.uint64), np.array([salt], dtype=np.uint64))
        self.generator: torch.Generator = make_generator(int(draft_seed[0]))  # the drafter's sampled drafts
        self.output_ids: list[int] = []
        self.seq: list[int] = list(prompt_ids)  # prompt + generated ids, kept in step with output_ids
        self.accept_lengths: list[int] = []
        self.tried_depths: list[int] = []  # beside accept_lengths: each step's tried depth (spec_step.tried_depth)
        self.steps: list[StepRecord] = []
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None if params.prompt_logprobs is None else []
        self.status = Status.WAITING
        self.prefilled = 0  # tokens of prefill_ids in the KV cache while it is prefilled in chunks
        self.num_cached_tokens = 0  # of the prompt, found in the prefix cache when its prefill began
        self.prefill_began = False  # (a prompt preempted mid-prefill finds its own chunks cached: not counted)
        self.finish_reason: str | None = None
        self.text: str | None = None
        self._checked_len = 0  # decoded characters already searched for stop strings
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.stream = TextStream(tokenizer) if tokenizer is not None else None

    @functools.cached_property
    def distinct_prompt_ids(self) -> np.ndarray:
        """The prompt's distinct token ids, once (the repetition penalty's rows are made from them
        at the request's first step and again after each preemption: PenaltyState)."""
        return np.unique(np.asarray(self.prompt_ids, dtype=np.int64))

    @property
    def seq_len(self) -> int:
        return len(self.seq)

    @property
    def prefill_ids(self) -> list[int]:
        """What a prefill sends: the prompt, or a resumed request's sequence but its root."""
        return self.seq[:-1] if self.output_ids else self.prompt_ids

    @property
    def prefill_len(self) -> int:
        return self.seq_len - 1 if self.output_ids else len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, tokens: list[int]) -> int:
        """Commit tokens one by one until a stop condition; returns how many were kept.

        With a tokenizer, stop strings apply: the text is cut before the stop string and the ids
        after the token that completed it; a stop token ends the ids but not the text.
        """
        kept = 0
        for tok in tokens:
            self.output_ids.append(tok)
            self.seq.append(tok)
            kept += 1
            if self.stream is not None:
                self.stream.add(tok)
            if tok in self.stop_ids:  # (its text is not returned, as vLLM leaves it out)
                self.finish_reason = "stop"
                if self.stream is not None:
                    self.text = self.stream.decode(self.output_ids[:-1])
            elif self.params.stop and self.stream is not None and self._hit_stop_string():
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                self.status = Status.FINISHED
                break
        return kept

    def _hit_stop_string(self) -> bool:
        # a new match must end inside the newest token's text, so each stop string is searched
        # from just before it; while min_tokens holds stop tokens back (specflow.penalties), the
        # text of the first min_tokens tokens ends no match (as vLLM's detokenizer has it)
        text = self.stream.exact(self.output_ids)
        checked = self._checked_len
        self._checked_len = len(text.rstrip("\ufffd"))  # a half-decoded character may still change
        if len(self.output_ids) <= self.params.min_tokens:
            return False
        hits = [at for at in (text.find(s, max(0, checked - len(s) + 1)) for s in self.params.stop) if at >= 0]
        if hits:
            self.text = text[:min(hits)]
        return bool(hits)

    def output(self, since: tuple[int, int] = (0, 0)) -> RequestOutput:
        """What the caller sees: a running request's text as streamed so far, a finished one's
        exact (cut before a stop string). With ``since`` = (tokens, steps) already seen, the lists
        hold what came after them alone (token ids and logprobs past the first ``tokens``, accept
        lengths, tried depths and steps past the first ``steps``, prompt logprobs only while no
        token was seen): a stream's update costs what it adds, not a copy of the whole output.
        The text stays whole (a stop string may still cut it)."""
        tokens, steps = since
        text = self.text
        if text is None and self.stream is not None:
            text = self.stream.decode(self.output_ids) if self.finished else self.stream.text(self.output_ids)
        return RequestOutput(self.id, self.prompt_ids, self.output_ids[tokens:], text,
                             self.finish_reason, self.accept_lengths[steps:], self.tried_depths[steps:],
                             self.steps[steps:], None if self.logprobs is None else self.logprobs[tokens:],
                             None if self.prompt_logprobs is None or tokens else list(self.prompt_logprobs),
                             self.num_cached_tokens)

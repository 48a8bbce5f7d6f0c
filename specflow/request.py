"""A request's life: committed tokens, stop checks, and what the caller gets back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from specflow.sampling import SamplingParams, TokenLogprob, make_generator
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
    steps: list[StepRecord] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token id when SamplingParams.logprobs is set

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))


class Request:
    """Engine-side state of one request. ``seq`` holds prompt + generated ids; the KV cache
    holds all of them but the last (the root of the next tree)."""

    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams,
                 eos_token_ids: list[int]):
        self.id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.generator: torch.Generator = make_generator(params.seed)
        self.output_ids: list[int] = []
        self.seq: list[int] = list(prompt_ids)  # prompt + generated ids, kept in step with output_ids
        self.accept_lengths: list[int] = []
        self.steps: list[StepRecord] = []
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.text: str | None = None
        self._checked_len = 0  # decoded characters already searched for stop strings
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))

    @property
    def seq_len(self) -> int:
        return len(self.seq)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, tokens: list[int], decode=None) -> int:
        """Commit tokens one by one until a stop condition; returns how many were kept.

        ``decode`` (ids -> str) enables stop strings; the text is cut before the stop string and
        the ids after the token that completed it.
        """
        kept = 0
        for tok in tokens:
            self.output_ids.append(tok)
            self.seq.append(tok)
            kept += 1
            if tok in self.stop_ids:
                self.finish_reason = "stop"
            elif self.params.stop and decode is not None and self._hit_stop_string(decode):
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                self.status = Status.FINISHED
                break
        return kept

    def _hit_stop_string(self, decode) -> bool:
        # a new match must end inside the newest token's text, so search from just before it
        text = decode(self.output_ids)
        start = max(0, self._checked_len - max(len(s) for s in self.params.stop) + 1)
        self._checked_len = len(text.rstrip("\ufffd"))  # a half-decoded character may still change
        hits = [at for at in (text.find(s, start) for s in self.params.stop) if at >= 0]
        if hits:
            self.text = text[:min(hits)]
        return bool(hits)

    def output(self, decode=None) -> RequestOutput:
        text = self.text if self.text is not None else (decode(self.output_ids) if decode else None)
        return RequestOutput(self.id, self.prompt_ids, list(self.output_ids), text,
                             self.finish_reason, list(self.accept_lengths), list(self.steps),
                             None if self.logprobs is None else list(self.logprobs))

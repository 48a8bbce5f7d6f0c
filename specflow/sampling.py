"""SamplingParams and target-logits processing (temperature -> top-k -> top-p -> min-p)."""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from specflow.runtime.transfer import to_device
from specflow.uniforms import counter_uniforms, salted_seeds


_FLOAT32_MAX, _FLOAT32_TINY = float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny)
_NUMBER, _INTEGER = ("a number", numbers.Real), ("an integer", numbers.Integral)
_PARAM_TYPES = {"temperature": _NUMBER, "top_p": _NUMBER, "min_p": _NUMBER, "top_k": _INTEGER, "max_tokens": _INTEGER,
                "seed": ("an integer or None", (numbers.Integral, type(None))),
                "logprobs": ("an integer or None", (numbers.Integral, type(None))),
                "prompt_logprobs": ("an integer or None", (numbers.Integral, type(None))),
                "frequency_penalty": _NUMBER, "presence_penalty": _NUMBER, "repetition_penalty": _NUMBER,
                "min_tokens": _INTEGER}


@dataclass
class SamplingParams:
    """How one request is sampled. ``temperature=0`` is greedy.

    ``top_k=-1`` keeps every token; ``seed=None`` draws a fresh seed; ``stop`` strings and
    ``stop_token_ids`` end generation (neither the stop string nor the stop token's text is
    returned; the token is among the ids); ``ignore_eos``
    keeps generating past the end-of-sequence token. ``logprobs=n`` records, for every committed
    token, its log-probability under the target and the ``n`` most likely alternatives
    (``None``: not recorded); ``prompt_logprobs=n`` does so for the prompt's tokens, each given
    the ones before it (the first, which has none, gets None).

    ``logit_bias`` (token id -> value added to its logit), ``frequency_penalty``,
    ``presence_penalty``, ``repetition_penalty`` (1 = off) and ``min_tokens`` (stop tokens and
    stop strings wait until that many tokens were generated) adjust the target's logits by the
    request's history, in every tree node by its own path (specflow.penalties).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 64
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    speculative: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    def __post_init__(self) -> None:
        for name, (what, kind) in _PARAM_TYPES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ValueError(f"{name} must be {what}, got {value!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        stops_ok = isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop)
        if self.stop is not None and not stops_ok:
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k == -1 or 1 <= self.top_k < 2**31, f"top_k must be -1 (off) or in [1, 2^31), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be None or >= 0, got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             f"prompt_logprobs must be None or >= 0, got {self.prompt_logprobs}"),
            # (the logits' arithmetic is float32: a value past it is inf, and inf x a count of 0 NaN)
            (_float32(self.frequency_penalty),
             f"frequency_penalty must be finite in float32 (|x| <= {_FLOAT32_MAX:.4g}), got {self.frequency_penalty}"),
            (_float32(self.presence_penalty),
             f"presence_penalty must be finite in float32 (|x| <= {_FLOAT32_MAX:.4g}), got {self.presence_penalty}"),
            (_FLOAT32_TINY <= self.repetition_penalty <= _FLOAT32_MAX,
             f"repetition_penalty must be in [{_FLOAT32_TINY:.4g}, {_FLOAT32_MAX:.4g}] (1 = off), "
             f"got {self.repetition_penalty}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}"),
            (self.logit_bias is None or _is_bias(self.logit_bias),
             f"logit_bias must map token ids (integers >= 0) to numbers finite in float32, got {self.logit_bias!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab: int) -> None:
        """Raise ValueError, naming the field, for a ``logit_bias`` or ``stop_token_ids`` id outside
        [0, vocab) (specflow.penalties indexes [B, V] tensors with them)."""
        for name, token_ids in (("logit_bias", self.logit_bias or ()), ("stop_token_ids", self.stop_token_ids)):
            bad = next((t for t in token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"{name} token id {bad} is not in [0, {vocab}), the target's vocabulary")

    @property
    def penalizes(self) -> bool:
        """Whether a penalty counts the request's history."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything of specflow.penalties applies to this request."""
        return self.penalizes or bool(self.logit_bias) or self.min_tokens > 0


def _float32(x: float) -> bool:
    """Whether ``x`` is finite as a float32 (NaN is not)."""
    return abs(x) <= _FLOAT32_MAX


def _is_bias(bias) -> bool:
    """Whether ``bias`` maps token ids (integers >= 0) to numbers finite in float32."""
    return isinstance(bias, dict) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0
        and isinstance(x, numbers.Real) and not isinstance(x, bool) and _float32(x) for t, x in bias.items())


@dataclass
class SamplingBatch:
    """Per-request sampling parameters of a batch as tensors, with each request's seed and the
    sequence position of the token it draws next: the keys of its counter-based uniforms (and a
    salt that keys a coin walk's apart, ``coin_walk``)."""

    temperature: Tensor   # [B] float
    top_k: Tensor         # [B] long, -1 = off
    top_p: Tensor         # [B] float
    min_p: Tensor         # [B] float
    seeds: np.ndarray     # [B] uint64
    positions: np.ndarray  # [B] int64: the index in its sequence of the token each row draws next
    salts: np.ndarray      # [B] uint64: 0, or what keys the row's coin walks apart from its seed's

    @staticmethod
    def from_params(params: list[SamplingParams], seeds: list[int], positions: list[int] | None = None,
                    salts: list[int] | None = None) -> "SamplingBatch":
        floats = np.array([(p.temperature, p.top_p, p.min_p) for p in params], dtype=np.float32).reshape(-1, 3)
        floats[:, 1] = np.maximum(floats[:, 1], np.finfo(np.float32).tiny)  # a top_p rounding to 0 keeps the top token
        floats = torch.from_numpy(floats)                                                 # [B, 3]
        return SamplingBatch(
            temperature=floats[:, 0],
            top_k=torch.from_numpy(np.array([p.top_k for p in params], dtype=np.int64)),
            top_p=floats[:, 1],
            min_p=floats[:, 2],
            seeds=np.array([s % 2**64 for s in seeds], dtype=np.uint64),
            positions=np.zeros(len(params), dtype=np.int64) if positions is None else np.array(positions, dtype=np.int64),
            salts=np.zeros(len(params), dtype=np.uint64) if salts is None else np.array(salts, dtype=np.uint64),
        )

    @property
    def greedy(self) -> Tensor:
        return self.temperature == 0

    def draws(self, depth: int, device: torch.device) -> Tensor:
        """[B, depth + 1] float64: row b's uniform for the target's own draw of the token at
        position ``positions[b] + d``. Keyed by the position alone, so a token is drawn with
        the same uniform by plain decoding and by any tree walk that draws it from the target
        (``walk.exact_match``): with the same seed, their outputs agree token for token."""
        offsets = np.arange(depth + 1)
        return to_device([counter_uniforms(self.seeds[:, None], self.positions[:, None] + offsets, 0)], device)[0]

    def coins(self, n: int, device: torch.device) -> Tensor:
        """[B, n] float64: this step's coin for tree node i, keyed by the root's position and i,
        so no draw and no other step's coin shares it (every node a verifier tests lies at a
        position the step commits)."""
        assert n < 2**24 - 1, "more coins than counter_uniforms' streams"
        streams = 1 + np.arange(n, dtype=np.uint64)
        return to_device([counter_uniforms(self.seeds[:, None], self.positions[:, None], streams)], device)[0]

    def coin_walk(self) -> "SamplingBatch":
        """The batch whose ``coins`` and ``draws`` a walk that tests drafts with coins uses
        (rejection over sampled drafts, threshold): a salted row's seed is mixed with its salt.
        The engine salts every request when its drafter learns across requests (an n-gram trie
        shared by all): such a drafter can draft a token another request of the same seed drew
        with the very uniforms this walk would test it with, which biases the walk. An exact-match
        walk takes no salt: its output is its draws' alone, whatever the drafts."""
        if not self.salts.any():
            return self
        return replace(self, seeds=salted_seeds(self.seeds, self.salts), salts=np.zeros_like(self.salts))


def target_probs(logits: Tensor, sampling: SamplingBatch) -> Tensor:
    """[B, N, V] logits -> [B, N, V] float32 probabilities after temperature, top-k, top-p, min-p.

    top-k keeps every token at least as likely as the k-th most likely (ties included), top-p
    the smallest prefix of the sorted distribution that reaches top_p (tied tokens in index
    order), min-p the tokens at least min_p x the top one; the top token always survives. Only
    top-p sorts, and only when a sampled row uses it. Greedy rows (temperature 0) become one-hot
    at the argmax, so every acceptance rule reduces to "accept iff the draft equals the argmax"
    for them. Non-finite logits cannot break a batch: +inf tokens share the row's mass, NaN ones
    get none, and a row left without mass (all -inf or NaN) is all zeros (``sample_rows`` gives
    token 0).
    """
    logits = logits.float()
    b, n, v = logits.shape
    sampled = ~sampling.greedy  # (the batch's parameters are on the host: reading them does not wait)
    if not bool(sampled.any()):
        return _one_hot(logits)
    greedy, temp, top_k, top_p, min_p = (x.view(b, 1, 1) for x in to_device(
        [sampling.greedy, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p], logits.device))
    scaled = (logits / temp.clamp(min=1e-5)).nan_to_num_(float("-inf"), torch.finfo(torch.float32).max, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    k = sampling.top_k[sampled]
    if bool((k > 0).any()):
        top = probs.topk(min(int(k.max()), v)).values                                # [B, N, max k]
        kth = top.gather(-1, (top_k.clamp(1, top.shape[-1]) - 1).expand(b, n, 1))   # [B, N, 1]
        probs = probs.masked_fill((top_k > 0) & (probs < kth), 0.0)
        # (only the rows cut: a row's bits must not depend on its batch-mates, or a seeded draw
        # could differ between plain and speculative decoding)
        probs = torch.where(top_k > 0, probs / probs.sum(-1, keepdim=True), probs)
    if bool((sampling.top_p[sampled] < 1).any()):
        # stable: tied tokens are cut by index, not by where the sort (of this batch's shape) put them
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)           # [B, N, V]
        mass_before = sorted_p.cumsum(-1) - sorted_p  # probability of the tokens sorted before
        cut = (mass_before >= top_p) & (top_p < 1)    # top_p 1: cumsum rounding cuts nothing
        probs = probs.scatter(-1, order, sorted_p.masked_fill(cut, 0.0))
    if bool((sampling.min_p[sampled] > 0).any()):
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    probs = (probs / probs.sum(-1, keepdim=True)).nan_to_num_(nan=0.0)  # (0 / 0: a row without mass), in place
    return torch.where(greedy, _one_hot(logits), probs) if not bool(sampled.all()) else probs


def _one_hot(logits: Tensor) -> Tensor:
    """[..., V] logits -> float32 one-hot at the argmax."""
    return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)


def sample_rows(probs: Tensor, u: Tensor, block: int = 1024) -> Tensor:
    """One token per row of [..., V] probabilities (any positive scale) by inverse CDF with the
    uniforms ``u`` [...] float64 (on probs' device): the first token whose cumulative mass passes
    u x the row's mass, [...] int64. Greedy rows (one-hot) give their argmax; a row without
    mass gives token 0.

    The CDF is walked in float64 in two levels, the masses of blocks of tokens (the largest
    divisor of V up to ``block``: 1002 for Llama-3's 128256) and then the tokens of the block
    found, so no float64 copy of the rows is made (a tree's [B, N, V]; a prime V has blocks of
    one token and makes one)."""
    *lead, v = probs.shape
    size = _block_size(v, block)
    blocks = probs.reshape(-1, v // size, size)                                       # [R, nb, blk]
    mass = blocks.sum(-1, dtype=torch.float64)                                         # [R, nb]
    cdf = mass.cumsum(-1)                                                              # [R, nb]
    target = u.reshape(-1, 1) * cdf[:, -1:]                                            # [R, 1]
    blk = torch.minimum(torch.searchsorted(cdf, target, right=True), _at_total(cdf))   # [R, 1]
    inner = blocks[torch.arange(len(blocks), device=blocks.device), blk[:, 0]].double().cumsum(-1)  # [R, blk]
    before = torch.where(blk > 0, cdf.gather(1, (blk - 1).clamp(min=0)), 0.0)          # [R, 1] mass of earlier blocks (<= target)
    token = torch.minimum(torch.searchsorted(inner, target - before, right=True), _at_total(inner))
    return (blk * size + token).view(lead)                                             # [...]


@functools.cache
def _block_size(v: int, most: int) -> int:
    return next(b for b in range(min(most, v), 0, -1) if v % b == 0)


def _at_total(cdf: Tensor) -> Tensor:
    """[R, n] cumulative masses -> [R, 1] the first index where each row reaches its total: an
    entry with mass (0 for a row without), where rounding at the top end lands."""
    return torch.searchsorted(cdf, cdf[:, -1:].contiguous())


def next_tokens(logits: Tensor, sampling: SamplingBatch, u: Tensor | None = None) -> Tensor:
    """One token per row of [B, V] target logits, [B] int64 on their device: the argmax for
    greedy rows, else a draw from the processed distribution with uniform ``u`` [B] (default:
    the row's draw for ``sampling.positions``, the token after the root). Nothing is read back:
    the host does not wait. A verifier drawing at a node of depth d passes that depth's uniform,
    ``sampling.draws(tree.depth_bound(), device)[:, d]``: one uniform at every depth would correlate its draws."""
    if bool(sampling.greedy.all()):
        return logits.argmax(-1)
    probs = target_probs(logits[:, None], sampling)[:, 0]  # [B, V], greedy rows one-hot
    return sample_rows(probs, sampling.draws(0, probs.device)[:, 0] if u is None else u)

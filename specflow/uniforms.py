"""Counter-based randomness: a request's seed, the uniforms its draws and coins use as a hash of
(seed, position, stream) rather than the next numbers of a stream, the salts that key requests'
uniforms apart, and the generator of its sampled drafts (README: Uniforms are counter-based)."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import Tensor


def salted_seeds(seeds: np.ndarray, salts: np.ndarray) -> np.ndarray:
    """[B] uint64 seeds keyed apart by [B] uint64 salts (a row with salt 0 keeps its seed)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps mod 2**64 by design
        salted = _mix64(_mix64(seeds + np.uint64(1)) ^ (salts * _GOLDEN))
    return np.where(salts == 0, seeds, salted)


_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 whose output bits all depend on every input bit."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def counter_uniforms(seeds: np.ndarray, positions: np.ndarray, streams: np.ndarray | int) -> Tensor:
    """Float64 U[0, 1) uniforms as a hash of (seed, position, stream), broadcast together (uint64
    seeds, positions below 2**40, streams below 2**24), as a CPU tensor: counter-based like
    JAX's and Philox's keys, so a draw depends on what it is for, not on how many came before.
    The top 53 bits of the mixed key make the float."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps mod 2**64 by design
        counter = (positions.astype(np.uint64) << np.uint64(24)) | np.asarray(streams, dtype=np.uint64)
        start = _mix64((seeds + np.uint64(1)) * _GOLDEN)  # splitmix64's output number seed + 1: the
        z = _mix64(start + counter * _GOLDEN)               # start of a splitmix64 stream, at counter
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def request_seed(seed: int | None) -> int:
    """A request's seed: its own, or a fresh one from the system's entropy when ``seed`` is None."""
    return seed if seed is not None else random.SystemRandom().randrange(2**63)


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator for one request's drafts (sampled drafting draws from it)."""
    g = torch.Generator()
    g.manual_seed(seed % 2**64)
    return g

"""Batch-independent random sampling by the exponential race, and per-(seed, position) generators."""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def _splitmix64(x: int) -> int:
    """One round of the splitmix64 finalizer: a bijection on 64-bit ints that mixes all bits."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, position: int) -> int:
    """Mixes a request seed (any 64-bit signed int) and an output position into a 63-bit seed."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) & _MASK63


def make_generator(seed: int, position: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator for one seeded request at one output position.

    Built anew each step from (seed, position) alone, so a seeded request draws the same
    randomness whatever batch it is in and however often it was preempted and recomputed.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(mix_seed(seed, position))
    return gen


def sample_from_probs(
    probs: torch.Tensor,  # [B, V] float32, rows sum to 1
    generators: dict[int, torch.Generator],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draws one token per row: argmax(probs / q) with q ~ Exp(1) i.i.d. is a draw from probs.

    Rows in `generators` take q from their own generator, one row at a time, so their token
    depends only on their own probs and generator; the other rows share one batch-wide draw
    from `generator` (torch's default generator when None). Returns [B] int64.
    """
    q = torch.empty_like(probs)  # [B, V]
    if len(generators) < probs.shape[0]:
        q.exponential_(generator=generator)
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    # Exp(1) can return exactly 0; clamp so a zero-prob token gives 0, never 0/0 = nan.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1)

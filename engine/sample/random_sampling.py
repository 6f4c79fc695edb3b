"""Batch-independent random sampling: per-row 63-bit noise keys from (seed, position) or a generator, and the draw."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import torch

from engine.host_copy import to_device
from engine.kernels.sampling import gumbel_sample

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


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """_splitmix64 of every element of a uint64 array (numpy's uint64 arithmetic wraps mod 2^64, as the masks do)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def seed_to_uint64(seed: int) -> np.uint64:
    """A request seed (any 64-bit signed int) as the uint64 that mix_seed masks it to."""
    return np.uint64(seed & _MASK64)


def mix_seeds(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:  # [S] int64, each in [0, 2^63)
    """mix_seed of each (seed, position) pair at once: seeds [S] uint64 (seed_to_uint64), positions [S] (>= 0)."""
    with np.errstate(over="ignore"):
        mixed = _splitmix64_array(_splitmix64_array(seeds.astype(np.uint64, copy=False)) ^ positions.astype(np.uint64))
    return (mixed & np.uint64(_MASK63)).astype(np.int64)


class SeededKeys(Mapping):
    """The seeded rows of a step as arrays: row -> the noise key mix_seed(seed, position), built without a generator per row.

    SamplingMetadata.generators may hold one of these instead of a dict of generators: the
    sampler reads the keys as one tensor. Looking a row up still gives a generator with that
    initial_seed(), for callers that want one.
    """

    def __init__(self, rows: np.ndarray, keys: np.ndarray) -> None:
        if rows.shape != keys.shape or rows.ndim != 1:
            raise ValueError(f"rows {rows.shape} and keys {keys.shape}: expected two equal 1-d arrays")
        self.rows = rows.astype(np.int64, copy=False)  # [S]
        self.keys = keys.astype(np.int64, copy=False)  # [S]
        self._index: dict[int, int] | None = None

    def _lookup(self) -> dict[int, int]:
        if self._index is None:
            self._index = {r: i for i, r in enumerate(self.rows.tolist())}
        return self._index

    def __getitem__(self, row: int) -> torch.Generator:
        gen = torch.Generator()
        gen.manual_seed(int(self.keys[self._lookup()[row]]))
        return gen

    def __iter__(self) -> Iterator[int]:
        return iter(self.rows.tolist())

    def __len__(self) -> int:
        return len(self.rows)


def make_generator(seed: int, position: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose initial_seed() is mix_seed(seed, position): one seeded request at one output position.

    The sampler reads only initial_seed() (the row's noise key), so the generator lives on
    the CPU whatever `device` says (kept for callers; creating device generators per row per
    step would cost for nothing). Built anew each step from (seed, position) alone, so a
    seeded request draws the same noise whatever batch it is in and however often it was
    preempted and recomputed.
    """
    del device
    gen = torch.Generator()
    gen.manual_seed(mix_seed(seed, position))
    return gen


def sampling_keys(
    num_rows: int,
    generators: Mapping[int, torch.Generator],
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:  # [B] int64, each in [0, 2^63)
    """One noise key per row: a seeded row's generator's initial_seed(), else a fresh draw.

    Unseeded rows draw their keys from `generator` (torch's default generator of `device`
    when None), one batched draw per step.
    """
    if len(generators) < num_rows:
        gen_device = device if generator is None else generator.device
        keys = torch.randint(0, _MASK63, (num_rows,), generator=generator, device=gen_device, dtype=torch.int64)
        keys = keys.to(device)
    else:
        keys = torch.empty(num_rows, dtype=torch.int64, device=device)
    if isinstance(generators, SeededKeys):
        if len(generators):
            keys[to_device(torch.from_numpy(generators.rows), device)] = to_device(torch.from_numpy(generators.keys), device)
    elif generators:
        rows = torch.tensor(list(generators), dtype=torch.int64)
        seeded = torch.tensor([gen.initial_seed() & _MASK63 for gen in generators.values()], dtype=torch.int64)
        keys[to_device(rows, device)] = to_device(seeded, device)
    return keys


def sample_from_logits(
    logits: torch.Tensor,  # [B, V] float32: temperature, top-k/top-p/min-p already applied (masked = -inf)
    generators: Mapping[int, torch.Generator],
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [B] int64
    """Draws one token per row from softmax(logits) by Gumbel-max with counter-based noise.

    argmax_v(logits[v] + G(key, v)) with G i.i.d. Gumbel(0, 1) is an exact draw from
    softmax(logits) (up to the noise's float32 resolution, see engine/kernels/sampling.py).
    G is a hash of (row key, v), so a seeded row's token depends only on its own logits,
    seed and position; the Triton kernel (GPU) and the torch reference (CPU) compute the
    same noise, so they agree too.
    """
    keys = sampling_keys(logits.shape[0], generators, generator, logits.device)  # [B]
    return gumbel_sample(logits, keys)

"""The counter-based Gumbel-max reference: blocked / candidate-only paths equal the plain definition."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.sampling import gumbel_sample_ref, gumbel_sample_simple_ref, uniform_noise_ref
from engine.sample.random_sampling import mix_seed

NEG_INF = float("-inf")


@pytest.mark.parametrize(
    "num_rows,vocab,kept_fraction",
    [(1, 151936, 1.0), (5, 151936, 0.001), (7, 1000, 1.0), (33, 50, 0.1), (300, 100, 0.05), (4, 3, 1.0)],
)
def test_fast_reference_equals_definition(num_rows, vocab, kept_fraction):
    gen = torch.Generator().manual_seed(vocab + num_rows)
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    if kept_fraction < 1.0:  # top-k style masks: the candidate-only path
        logits = torch.where(torch.rand(num_rows, vocab, generator=gen) < kept_fraction, logits, NEG_INF)
        logits[:, 0] = 0.5
    keys = torch.randint(0, 2**63 - 1, (num_rows,), generator=gen)
    keys[0] = 2**63 - 1  # both key words all ones
    keys[-1] = -1  # a greedy row
    if num_rows > 2:
        keys[1] = 0
        logits[1] = torch.where(logits[1] > NEG_INF, 0.0, NEG_INF)  # every kept token tied
    out = gumbel_sample_ref(logits, keys)
    assert torch.equal(out, gumbel_sample_simple_ref(logits, keys))
    assert int(out[-1]) == int(logits[-1].argmax())
    assert bool(torch.isfinite(logits.gather(1, out[:, None])).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_dense_path_with_temperature_over_several_row_blocks_equals_definition(dtype):
    """The CPU dense path (numpy hash and argmax) over more rows than one block, greedy rows among them, a
    per-row temperature and low-precision logits: the definition's tokens."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(600, 1000, generator=gen) * 4).to(dtype)  # 262 rows per block: three blocks
    logits[5] = logits[5].round()  # ties
    keys = torch.randint(0, 2**63 - 1, (600,), generator=gen)
    keys[::7] = -1  # greedy rows in every block
    temperature = torch.rand(600, generator=gen) + 0.25
    out = gumbel_sample_ref(logits, keys, temperature)
    assert torch.equal(out, gumbel_sample_simple_ref(logits, keys, temperature))
    assert torch.equal(out[::7], logits[::7].float().argmax(dim=-1))


def test_noise_is_uniform_and_keyed():
    keys = torch.tensor([mix_seed(s, 0) for s in range(64)])
    u = uniform_noise_ref(keys, 4096)  # [64, 4096]
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005
    hist = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert float((hist - 1 / 16).abs().max()) < 0.003
    assert not torch.equal(u[0], u[1])
    assert torch.equal(uniform_noise_ref(keys[3:4], 4096)[0], u[3])  # a row's noise ignores the others


def test_golden_token():
    """Pins the noise function: a changed hash changes every seeded request's tokens (update deliberately)."""
    logits = torch.zeros(1, 1000)
    keys = torch.tensor([mix_seed(42, p) for p in range(6)])
    tokens = gumbel_sample_ref(logits.expand(6, 1000), keys).tolist()
    assert tokens == GOLDEN_TOKENS


# Computed once with gumbel_sample_ref (also what the Triton kernel must give: tests/gpu/test_kernels.py).
GOLDEN_TOKENS = [367, 470, 404, 591, 967, 589]


def test_warm_up_row_classes_cover_every_chunk_length_the_heuristic_picks():
    from engine.kernels.sampling import gumbel_row_classes, gumbel_tiles_per_chunk

    for vocab, max_rows in [(151936, 256), (151936, 1024), (32000, 64), (512, 8)]:
        rows = gumbel_row_classes(vocab, max_rows)
        picked = {gumbel_tiles_per_chunk(n, vocab) for n in range(1, max_rows + 1)}
        assert sorted(gumbel_tiles_per_chunk(n, vocab) for n in rows) == sorted(picked)  # one row count per variant
        assert rows[0] == 1 and all(n <= max_rows for n in rows)
    assert len(gumbel_row_classes(151936, 256)) == 3  # Qwen's vocabulary at 256 rows: chunks of 1, 2 and 8 tiles

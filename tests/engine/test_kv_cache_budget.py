"""The KV cache's share of a GPU (engine/worker/memory.py) from device numbers passed in: what fits, and errors that
say who holds the memory and what to change."""

from __future__ import annotations

import pytest

from engine.worker.memory import DeviceMemory, kv_cache_budget

GIB = 2**30
BLOCK = 1835008  # the block of the report: 1.75 MiB


def budget(total, free, reserved, engine, utilization, **kw):
    return kv_cache_budget(DeviceMemory(total, free, reserved, "cuda:0"), engine_bytes=engine,
                           utilization=utilization, block_bytes=BLOCK, **kw)


def test_the_share_less_the_weights_goes_to_the_kv_cache():
    # An empty 140 GiB device, after 1 GiB of weights and a 0.5 GiB CUDA context.
    assert budget(140 * GIB, int(138.5 * GIB), 1 * GIB, 1 * GIB, 0.4) == int(140 * GIB * 0.4) - GIB


def test_what_others_hold_does_not_shrink_the_share_while_it_fits():
    # Another engine at 0.4 in another process holds 56 GiB: a second at 0.4 still gets its whole share.
    assert budget(140 * GIB, int(82.5 * GIB), 1 * GIB, 1 * GIB, 0.4) == int(140 * GIB * 0.4) - GIB


def test_a_share_that_does_not_fit_names_the_holders_and_the_share_that_would():
    # The report: an engine of this process not shut down holds 56 GiB, then a second asks for 0.9.
    with pytest.raises(ValueError) as info:
        budget(140 * GIB, int(82.5 * GIB), 57 * GIB, 1 * GIB, 0.9)
    message = str(info.value)
    assert "gpu_memory_utilization=0.9 gives this engine 126.00 GiB of cuda:0's 140.00 GiB" in message
    assert "its KV cache would take 125.00 GiB, but only 82.50 GiB is free" in message
    assert "this process holds 56.00 GiB besides this engine's 1.00 GiB" in message
    assert "other processes and CUDA contexts hold 0.50 GiB" in message
    # (82.5 free + 1 of its own) / 140 = 0.596...: a share of 0.59 fits, 0.60 would not.
    assert "Lower gpu_memory_utilization to at most 0.59" in message
    assert "LLM.shutdown()" in message and "RolloutWorker.shutdown()" in message
    assert budget(140 * GIB, int(82.5 * GIB), 57 * GIB, 1 * GIB, 0.59) == int(140 * GIB * 0.59) - GIB
    with pytest.raises(ValueError, match="only 82.50 GiB is free"):
        budget(140 * GIB, int(82.5 * GIB), 57 * GIB, 1 * GIB, 0.60)


def test_memory_held_by_other_processes_is_named_as_theirs():
    with pytest.raises(ValueError) as info:
        budget(100 * GIB, 30 * GIB, 3 * GIB, 2 * GIB, 0.5)
    message = str(info.value)
    assert "this process holds 1.00 GiB besides this engine's 2.00 GiB" in message
    assert "other processes and CUDA contexts hold 67.00 GiB" in message
    assert "at most 0.32" in message


def test_no_free_block_at_all_asks_to_free_memory():
    with pytest.raises(ValueError, match=r"only 0.00 GiB is free.*\. Free memory: shut down"):
        budget(100 * GIB, 0, 2 * GIB, 2 * GIB, 0.5)


def test_a_share_smaller_than_the_weights_says_how_much_to_raise_it():
    with pytest.raises(ValueError) as info:
        budget(100 * GIB, 97 * GIB, 2 * GIB, 2 * GIB, 0.01)
    message = str(info.value)
    assert "but its weights already take 2.00 GiB" in message and "one KV block of 1.75 MiB" in message
    assert "Raise gpu_memory_utilization to at least 0.03" in message
    assert budget(100 * GIB, 97 * GIB, 2 * GIB, 2 * GIB, 0.03) == int(100 * GIB * 0.03) - 2 * GIB


def test_an_explicit_size_is_used_as_given_when_it_is_free():
    assert budget(100 * GIB, 50 * GIB, 2 * GIB, 2 * GIB, 0.9, kv_cache_memory_bytes=1 << 28) == 1 << 28
    with pytest.raises(ValueError) as info:
        budget(100 * GIB, 10 * GIB, 40 * GIB, 2 * GIB, 0.9, kv_cache_memory_bytes=20 * GIB)
    message = str(info.value)
    assert "kv_cache_memory_bytes=21474836480 (20.00 GiB) is more than the 10.00 GiB free on cuda:0" in message
    assert "this process holds 38.00 GiB besides this engine's 2.00 GiB" in message
    assert "other processes and CUDA contexts hold 50.00 GiB" in message

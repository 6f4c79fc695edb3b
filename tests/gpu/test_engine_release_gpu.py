"""GPU tier (issue #29): an engine closed in-process gives all its device memory back before shutdown returns.

Built and closed five times in one process (LLM, LLM with a draft model, RolloutWorker with multiprocess=False),
each time at gpu_memory_utilization=0.4, torch.cuda.memory_allocated() comes back to what it was before the
first build, and so does the device's free memory (the weights and the KV cache live in fixed-address regions
outside the caching allocator: engine/worker/device_memory.py), with the collector off (no gc.collect() anywhere), and every build gets the same KV cache and
serves the same greedy tokens. Then, as in the report, a multiprocess RolloutWorker at 0.4 starts after an
in-process one at 0.4 was used in a `with` block.
"""

from __future__ import annotations

import gc

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.release import release_device_caches
from rollout import RolloutWorker
from test_engine_release import collector_off  # tests/engine (tests/gpu/conftest.py): no collection inside

pytestmark = pytest.mark.gpu

ENGINE_ARGS = dict(device="cuda", max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 17, 42, 8, 99, 3] * 4}, {"prompt_token_ids": [7, 7, 120, 64, 1, 2, 33]},
           {"prompt_token_ids": [150, 2, 9]}]
ROUNDS = 5


# The device's free memory moves by a few MiB for reasons of its own (driver bookkeeping); an engine's KV cache
# alone is gigabytes at 0.4.
_DEVICE_SLACK = 64 << 20


def settled_allocated() -> tuple[int, int, int]:
    """(allocated, reserved, device free) bytes with nothing queued and no cuBLAS workspace or cached block
    held: the level every shutdown must come back to."""
    release_device_caches(torch.device("cuda", torch.cuda.current_device()))
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]


def assert_given_back(before: tuple[int, int], what: str) -> None:
    """memory_allocated() and memory_reserved() are at most what they were before the first build. No tolerance:
    shutdown frees cuBLAS's workspaces too, and the baseline was taken without them."""
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    free = torch.cuda.mem_get_info()[0]
    assert free >= before[2] - _DEVICE_SLACK, (
        f"{what}: the device has {(before[2] - free) / 2**20:.0f} MiB less free than before the first build "
        "(a fixed-address region not closed?)")
    if allocated <= before[0] and reserved <= before[1]:
        return
    gc.collect()  # only to say what held the memory
    after_gc = torch.cuda.memory_allocated()
    holder = "a reference cycle (gc.collect() frees it)" if after_gc <= before[0] else "a live reference"
    pytest.fail(f"{what}: {allocated - before[0]} bytes still allocated and {reserved - before[1]} more reserved after "
                f"shutdown; {after_gc - before[0]} allocated after gc.collect(): {holder}\n"
                f"{torch.cuda.memory_summary(abbreviated=True)}")


def kv_cache_bytes(worker) -> int:
    return sum(layer.kv_cache.numel() * layer.kv_cache.element_size() for layer in worker.attn_layers)


def engine_bytes(worker) -> int:
    """What the engine holds: the allocator's tensors and the fixed-address regions (weights, KV cache)."""
    return torch.cuda.memory_allocated() + worker._region_bytes()


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("speculative", [None, "draft_model"])
def test_llm_built_and_closed_five_times_gives_its_memory_back(tiny_checkpoint, speculative):
    path = tiny_checkpoint("llama")
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": path} if speculative else None
    before = settled_allocated()
    first: tuple[int, list[list[int]]] | None = None
    with collector_off():
        for round_ in range(ROUNDS):
            llm = LLM(path, speculative_config=spec, **ENGINE_ARGS)
            worker = llm.engine_core.executor.worker
            assert worker.model_runner.cuda_graphs is not None  # the graphs and their pool are part of what goes
            assert (worker.draft_proposer is not None and worker.draft_proposer.cuda_graphs is not None) == bool(spec)
            assert engine_bytes(worker) >= before[0] + kv_cache_bytes(worker)
            served = (llm.engine_core.num_blocks, token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)))
            first = first or served
            assert served == first, f"round {round_}: another KV cache size or other tokens than round 0"
            del worker
            llm.shutdown()  # `llm` still references the engine
            assert_given_back(before, f"LLM round {round_}")
            del llm


def test_rollout_worker_in_process_built_and_closed_five_times_gives_its_memory_back(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    before = settled_allocated()
    first: tuple[int, list[list[int]]] | None = None
    with collector_off():
        for round_ in range(ROUNDS):
            with RolloutWorker(model=path, multiprocess=False, **ENGINE_ARGS) as rw:
                core = rw.engine.engine_core.engine_core
                assert engine_bytes(core.executor.worker) >= before[0] + kv_cache_bytes(core.executor.worker)
                served = (core.num_blocks, token_ids(rw.generate(PROMPTS, GREEDY)))
                del core
            first = first or served
            assert served == first, f"round {round_}: another KV cache size or other tokens than round 0"
            assert_given_back(before, f"RolloutWorker round {round_}")  # `rw` still names it after the block
            del rw


def test_multiprocess_worker_starts_after_an_in_process_one_at_the_same_utilization(tiny_checkpoint):
    """The report: an in-process worker at 0.4 used in a with block, then a multiprocess one at 0.4 (whose
    engine process sizes its cache from the device's free memory)."""
    path = tiny_checkpoint("llama")
    before = settled_allocated()
    with collector_off():
        with RolloutWorker(model=path, multiprocess=False, **ENGINE_ARGS) as first:
            expected = token_ids(first.generate(PROMPTS, GREEDY))
        assert_given_back(before, "the in-process RolloutWorker")
        with RolloutWorker(model=path, multiprocess=True, **ENGINE_ARGS) as second:
            assert token_ids(second.generate(PROMPTS, GREEDY)) == expected
        assert_given_back(before, "after the multiprocess RolloutWorker")

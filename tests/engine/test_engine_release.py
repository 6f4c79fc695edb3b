"""An in-process engine (LLM, RolloutWorker, AsyncLLM) frees its weights, buffers and KV cache when shutdown returns:
with the collector off and the engine still referenced, every one of their storages is dead; a second engine
then serves the same greedy tokens, and the closed one refuses work with a clear error."""

from __future__ import annotations

import asyncio
import gc
import weakref
from contextlib import contextmanager

import pytest

from engine import LLM, SamplingParams
from engine.async_llm import AsyncLLM
from engine.exceptions import EngineDeadError
from rollout import RolloutWorker

ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 17, 42, 8, 99, 3]}, {"prompt_token_ids": [7, 7, 120, 64]}]


@contextmanager
def collector_off():
    """No automatic collection inside: whatever dies here dies by reference counting alone."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def storage_refs(worker) -> dict[str, weakref.ref]:
    """Weak references to the storage of every parameter, buffer and KV cache tensor of the worker's models.

    A storage keeps its Python object while it lives (torch preserves it), so the reference dies exactly
    when the memory is freed. Built here so that no strong reference to a tensor outlives the call."""
    refs = {}
    for label, model in (("model", worker.model), ("draft", worker.draft_model)):
        if model is None:
            continue
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            refs[f"{label}.{name}"] = weakref.ref(tensor.untyped_storage())
    for i, layer in enumerate(worker.attn_layers):
        refs[f"kv_cache[{i}]"] = weakref.ref(layer.kv_cache.untyped_storage())
    return refs


def assert_all_dead(refs: dict[str, weakref.ref]) -> None:
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} storages outlive shutdown: {alive[:8]}"


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_storage_refs_die_only_with_the_memory():
    """The probe itself: a storage's weak reference lives while a tensor (or a view of it) does."""
    import torch

    tensor = torch.zeros(8)
    view = tensor[2:4]
    ref = weakref.ref(tensor.untyped_storage())
    del tensor
    assert ref() is not None  # the view still holds the memory
    del view
    assert ref() is None


@pytest.mark.parametrize("speculative", [None, "draft_model"])
def test_llm_shutdown_frees_every_storage_and_a_new_llm_serves_the_same(tiny_checkpoint, speculative):
    path = tiny_checkpoint("llama")
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": path} if speculative else None
    llm = LLM(path, speculative_config=spec, **ENGINE_ARGS)
    expected = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    refs = storage_refs(llm.engine_core.executor.worker)
    assert any(name.startswith("draft.") for name in refs) == (speculative is not None)
    with collector_off():
        llm.shutdown()
        assert_all_dead(refs)  # while `llm` still references the engine
        llm.shutdown()  # idempotent
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.engine_core.sleep(1)  # a control that reaches the worker

    with LLM(path, speculative_config=spec, **ENGINE_ARGS) as second:
        assert token_ids(second.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        refs = storage_refs(second.engine_core.executor.worker)
        with collector_off():
            second.close()
            assert_all_dead(refs)


def test_shutdown_after_a_device_error_still_frees_every_storage(tiny_checkpoint):
    """A failed kernel leaves the device reporting an error on every later wait: shutdown drops the tensors
    anyway and does not raise it again."""
    llm = LLM(tiny_checkpoint("llama"), **ENGINE_ARGS)
    worker = llm.engine_core.executor.worker

    def device_error() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    worker.synchronize = device_error  # the one call through which the worker waits for its device
    refs = storage_refs(worker)
    del worker
    with collector_off():
        llm.shutdown()
        assert_all_dead(refs)


def test_llm_dropped_without_shutdown_is_freed_by_reference_counting(tiny_checkpoint):
    """No reference cycle holds the engine: the last reference gone, its worker and weights go too."""
    llm = LLM(tiny_checkpoint("llama"), **ENGINE_ARGS)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    worker = llm.engine_core.executor.worker
    refs = storage_refs(worker)
    objects = {"EngineCore": weakref.ref(llm.engine_core), "Worker": weakref.ref(worker),
               "ModelRunner": weakref.ref(worker.model_runner), "model": weakref.ref(worker.model)}
    del worker
    llm.engine_core.sleep(1)  # makes the worker's sleeper, which points back at the worker
    llm.engine_core.wake_up()
    with collector_off():
        del llm
        alive = [name for name, ref in objects.items() if ref() is not None]
        assert not alive, f"still alive without a collection: {alive}"
        assert_all_dead(refs)


def test_rollout_worker_with_block_frees_every_storage(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    was_enabled = gc.isenabled()
    try:
        with RolloutWorker(model=path, multiprocess=False, **ENGINE_ARGS) as rw:
            expected = token_ids(rw.generate(PROMPTS, GREEDY))
            refs = storage_refs(rw.engine.engine_core.engine_core.executor.worker)
            gc.disable()  # off through __exit__ (the shutdown) and the check after it
        assert_all_dead(refs)  # `rw` still names the worker after its with block
    finally:
        if was_enabled:
            gc.enable()
    with pytest.raises(RuntimeError, match="shut down"):
        rw.generate(PROMPTS, GREEDY)
    rw.shutdown()  # idempotent
    frontends = {"RolloutWorker": weakref.ref(rw), "AsyncLLM": weakref.ref(rw.engine)}
    with collector_off():
        del rw
        alive = [name for name, ref in frontends.items() if ref() is not None]
        assert not alive, f"a reference cycle holds {alive}"

    with RolloutWorker(model=path, multiprocess=False, **ENGINE_ARGS) as second:
        assert token_ids(second.generate(PROMPTS, GREEDY)) == expected


def test_async_llm_shutdown_frees_every_storage(tiny_checkpoint):
    path = tiny_checkpoint("llama")

    async def serve_and_close() -> list[list[int]]:
        llm = AsyncLLM.from_engine_args(model=path, multiprocess=False, **ENGINE_ARGS)
        finals = []
        for i, prompt in enumerate(PROMPTS):
            async for out in llm.generate(prompt, GREEDY, f"r{i}"):
                final = out
            finals.append(final)
        refs = storage_refs(llm.engine_core.engine_core.executor.worker)
        with collector_off():
            llm.shutdown()
            assert_all_dead(refs)
            llm.shutdown()  # idempotent
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate(PROMPTS[0], GREEDY, "after"):
                pass
        with pytest.raises(EngineDeadError):
            await llm.pause_generation("keep")
        frontend = weakref.ref(llm)
        with collector_off():
            del llm
            await asyncio.sleep(0)  # the cancelled output task finishes
            assert frontend() is None, "a reference cycle holds the AsyncLLM"
        return token_ids(finals)

    first = asyncio.run(serve_and_close())
    assert asyncio.run(serve_and_close()) == first


def test_an_in_process_engine_leaves_the_callers_heap_collectable(tiny_checkpoint):
    """gc.freeze() belongs to the engine's own process (engine/core_proc.py): an in-process engine moves nothing
    of its caller's into the permanent generation, so what the caller drops later is still collected."""

    class Node:
        pass

    held = Node()
    held.self = held  # a cycle the caller still holds while the engine is built
    ref = weakref.ref(held)
    frozen = gc.get_freeze_count()
    llm = LLM(tiny_checkpoint("llama"), **ENGINE_ARGS)
    try:
        assert gc.get_freeze_count() == frozen
        del held
        gc.collect()
        assert ref() is None, "the caller's garbage was frozen by the engine"
    finally:
        llm.shutdown()

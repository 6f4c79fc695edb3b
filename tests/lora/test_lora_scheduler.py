"""The scheduler with LoRA, without a device: at most max_loras adapters run at once, and block hashes are keyed by adapter."""

from __future__ import annotations

from engine.config import CacheConfig, LoRAConfig, SchedulerConfig
from engine.core.block_pool import hash_block_tokens
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams
from engine.worker.runner_output import ModelRunnerOutput

BLOCK_SIZE = 4


def _scheduler(max_loras: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), CacheConfig(block_size=BLOCK_SIZE),
                     max_model_len=64, num_blocks=64, lora=LoRAConfig(enable_lora=True, max_loras=max_loras))


def _request(req_id: str, lora_id: int, max_tokens: int, prompt=(1, 2, 3, 4, 5)) -> Request:
    lora = LoRARequest(f"adapter-{lora_id}", lora_id, f"/adapters/{lora_id}") if lora_id else None
    request = Request(req_id, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                      eos_token_id=None, lora_request=lora)
    request.lora_cache_key = lora_id or None  # what the EngineCore's registry gives it
    return request


def _step(scheduler: Scheduler) -> set[str]:
    """One scheduled step whose every sampling row samples token 7; returns the ids it ran."""
    out = scheduler.schedule()
    ran = list(out.num_scheduled_tokens)
    scheduler.update_from_output(out, ModelRunnerOutput(ran, [[7] for _ in ran]))
    return set(ran)


def test_a_request_whose_adapter_does_not_fit_waits_while_later_ones_run():
    scheduler = _scheduler(max_loras=1)
    for request in [_request("a1", 1, 2), _request("b", 2, 1), _request("base", 0, 1), _request("a2", 1, 1)]:
        scheduler.add_request(request)
    assert _step(scheduler) == {"a1", "base", "a2"}  # adapter 2 would be the second: b waits
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    assert _step(scheduler) == {"a1"}  # base and a2 finished (max_tokens 1); a1 still holds adapter 1's place
    assert _step(scheduler) == {"b"}  # a1 finished: b runs
    assert not scheduler.has_unfinished_requests()


def test_two_adapters_fit_two_places():
    scheduler = _scheduler(max_loras=2)
    for request in [_request("a", 1, 2), _request("b", 2, 2), _request("c", 3, 2)]:
        scheduler.add_request(request)
    assert _step(scheduler) == {"a", "b"}
    assert _step(scheduler) == {"a", "b"}
    assert _step(scheduler) == {"c"}


def test_block_hashes_differ_by_adapter_in_every_block():
    tokens = [1, 2, 3, 4]
    base, one, two = (hash_block_tokens(None, tokens, key) for key in (None, 1, 2))
    assert len({base, one, two}) == 3
    assert hash_block_tokens(base, tokens, 1) != hash_block_tokens(base, tokens)  # not only the first block
    assert hash_block_tokens(None, tokens, 0) != base  # key 0 is a key, not "none"


def test_the_same_prompt_hits_only_the_blocks_of_its_own_adapter():
    scheduler = _scheduler(max_loras=2)
    prompt = list(range(1, 10))  # two full blocks of 4, and one token
    requests = [_request("first", 1, 1, prompt), _request("other-adapter", 2, 1, prompt),
                _request("base", 0, 1, prompt), _request("same-adapter", 1, 1, prompt)]
    for request in requests:  # one at a time, each after the one before has finished
        scheduler.add_request(request)
        _step(scheduler)
    assert {r.request_id: r.num_cached_tokens for r in requests} == {
        "first": 0, "other-adapter": 0, "base": 0, "same-adapter": 2 * BLOCK_SIZE}

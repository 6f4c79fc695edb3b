"""SamplingInputs: a step's SamplingMetadata equals one built from scratch, its request-constant part reused or not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.core.sched_output import NewRequestData
from engine.sample.random_sampling import mix_seed
from engine.sampling_params import SamplingParams
from engine.worker.request_state import RequestState
from engine.worker.sampling_inputs import SamplingInputs

VOCAB = 50


def add(state: RequestState, eos: dict, req_id: str, num_prompt: int = 4, **params) -> int:
    params.setdefault("max_tokens", 20)
    new = NewRequestData(req_id=req_id, token_ids=list(range(3, 3 + num_prompt)), num_prompt_tokens=num_prompt,
                         sampling_params=SamplingParams(**params), block_ids=[0], num_computed_tokens=0, eos_token_id=1)
    eos[req_id] = 1
    return state.add_request(new)


def grow(state: RequestState, slot: int, token_id: int = 7) -> None:
    state.append_token(slot, token_id)


def comparable(md) -> dict:
    """The metadata's fields as plain values (tensors as lists, the seeded keys as {entry: key})."""
    out = {}
    for name, value in vars(md).items():
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        elif name == "generators":
            value = dict(zip(value.rows.tolist(), value.keys.tolist()))
        out[name] = value
    return out


def fresh(state: RequestState, eos: dict, slots, req_ids, rows, offsets=None):
    """The same step's metadata from an object that has never built one (nothing to reuse)."""
    return comparable(SamplingInputs(state, torch.device("cpu"), VOCAB, "raw_logprobs", eos)
                      .metadata(np.array(slots), req_ids, np.array(rows), offsets))


PARAMS = [
    dict(temperature=0.7, seed=11, min_tokens=2),
    dict(temperature=0.0),
    dict(temperature=1.0, top_k=5, top_p=0.9, logprobs=2),
    dict(temperature=1.0, presence_penalty=0.5, bad_words=["x"], bad_words_token_ids=[[9]], logit_bias={4: 1.0}),
    dict(temperature=1.0, allowed_token_ids=[3, 4, 5], seed=3),
]


@pytest.mark.parametrize("offsets", [None, "spec"])
def test_reused_and_rebuilt_metadata_equal_metadata_built_from_scratch(offsets):
    """Steps with the same requests (reused part), with requests growing past min_tokens (seeded keys and
    min_tokens follow), with a request replaced in the same slot and with another entry order (rebuilt)."""
    state, eos = RequestState(8, 64, 8), {}
    slots = [add(state, eos, f"r{i}", **p) for i, p in enumerate(PARAMS)]
    inputs = SamplingInputs(state, torch.device("cpu"), VOCAB, "raw_logprobs", eos)
    req_ids = [f"r{i}" for i in range(len(PARAMS))]

    def check(order):
        rows = np.array(order)
        entry_slots = np.array(slots)[rows]
        offs = None if offsets is None else np.arange(len(rows)) % 2
        got = comparable(inputs.metadata(entry_slots, req_ids, rows, offs))
        assert got == fresh(state, eos, entry_slots, req_ids, rows, offs)
        return got

    first = check([0, 1, 2, 3, 4])
    assert first["min_tokens"] and first["generators"]
    for _ in range(3):  # the requests grow: their seeded keys move on, r0 passes its min_tokens
        for s in slots:
            grow(state, s)
        step = check([0, 1, 2, 3, 4])
    assert step["min_tokens"] == {} and step["generators"] != first["generators"]
    check([4, 3, 2, 1, 0])  # another order: rebuilt
    check([0, 0, 2])  # rows repeating (speculative entries)
    check([0, 1, 2, 3, 4])
    state.remove_request("r2")
    slots[2] = add(state, eos, "r2", temperature=0.3, seed=5)  # the same slot, other parameters
    replaced = check([0, 1, 2, 3, 4])
    assert replaced["temperature"][2] == pytest.approx(0.3) and replaced["top_k"] is None


def test_seeded_keys_follow_the_output_position():
    state, eos = RequestState(4, 32, 4), {}
    slot = add(state, eos, "a", num_prompt=4, temperature=1.0, seed=42)
    inputs = SamplingInputs(state, torch.device("cpu"), VOCAB, "raw_logprobs", eos)
    keys = []
    for _ in range(3):
        md = inputs.metadata(np.array([slot]), ["a"], np.array([0]))
        keys.append(int(md.generators.keys[0]))
        grow(state, slot)
    assert keys == [mix_seed(42, position) for position in range(3)]


def test_a_runner_that_forgets_its_requests_drops_the_reused_inputs():
    # The reused part holds device tensors (temperatures, top-k/p...): a worker shutting down (ModelRunner.release ->
    # reset_requests) must not keep them, or its device memory does not come back (tests/gpu/test_engine_release_gpu).
    from engine.worker.model_runner import ModelRunner

    state, eos = RequestState(4, 64, 8), {}
    inputs = SamplingInputs(state, torch.device("cpu"), VOCAB, "raw_logprobs", eos)
    slots = np.array([add(state, eos, "a", temperature=0.7), add(state, eos, "b", top_k=3)])
    inputs.metadata(slots, ["a", "b"], np.arange(2))
    assert inputs._last is not None

    class Runner:  # the runner's state reset_requests reads, nothing else
        reset_requests = ModelRunner.reset_requests

    runner = Runner()
    runner.state, runner.eos_token_ids, runner.sampling_inputs, runner._in_flight = state, eos, inputs, None
    runner.reset_requests()
    assert inputs._last is None and not state.req_id_to_slot and not eos

"""RequestState: the model runner's per-slot arrays hold each request's tokens, however they were written."""

from __future__ import annotations

from engine.core.sched_output import NewRequestData
from engine.sampling_params import SamplingParams
from engine.worker.request_state import RequestState


def new(req_id: str, token_ids: list[int], num_prompt: int | None = None) -> NewRequestData:
    return NewRequestData(req_id=req_id, token_ids=list(token_ids), num_prompt_tokens=num_prompt or len(token_ids),
                          sampling_params=SamplingParams(max_tokens=8), block_ids=[0], num_computed_tokens=0)


def test_rows_hold_each_requests_tokens_when_samples_of_one_prompt_share_the_write():
    """Requests with the tokens of the one added before them copy its row; a freed and reused slot, a request
    grown past its prompt, other tokens, a prefix or an extension of them are written from their own list."""
    state = RequestState(8, 32, 4)
    prompt = [5, 6, 7, 8, 9]
    expected: dict[str, list[int]] = {}

    def add(req_id, token_ids):
        state.add_request(new(req_id, token_ids))
        expected[req_id] = list(token_ids)
        for rid, ids in expected.items():
            slot = state.req_id_to_slot[rid]
            assert state.token_ids[slot, : len(ids)].tolist() == ids, (req_id, rid)
            assert int(state.num_tokens[slot]) == len(ids)

    add("a", prompt)
    add("b", prompt)  # the same prompt: copied from a's row
    state.append_token(state.req_id_to_slot["a"], 40)  # a samples: its row grows past the prompt
    expected["a"].append(40)
    add("c", prompt)
    state.remove_request("a")
    del expected["a"]
    add("d", [1, 2, 3])  # takes a's slot back: other tokens over the row a's prompt was written to
    state.remove_request("d")
    del expected["d"]
    state.remove_request("c")
    del expected["c"]
    add("e", [11, 12])  # reuses a freed slot
    add("f", [11, 12])
    add("g", [11, 12, 13])  # an extension of the last ids
    state.remove_request("e")
    del expected["e"]
    add("h", [11])  # a prefix
    add("i", [11])
    add("j", [5, 6, 7, 8, 9, 40])  # a's tokens when it left, as a preempted request resumes with them
    assert sorted(expected) == ["b", "f", "g", "h", "i", "j"]

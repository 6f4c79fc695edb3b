"""OutputProcessor fed hand-made EngineCoreOutputs: logprobs, prompt logprobs, finish reasons, n > 1."""

import gc
import weakref

import numpy as np
import pytest

from engine.output_processor import OutputProcessor, ParentRequest
from engine.outputs import Logprob
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.wire import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists

PROMPT_IDS = [10, 11, 12, 13]


def add(proc, req_id="r", **params):
    sp = SamplingParams(max_tokens=100, **params)
    proc.add_request(EngineCoreRequest(req_id, PROMPT_IDS, sp, eos_token_id=0), prompt="p")
    return sp


def lp_rows(rows):
    """LogprobsLists from [(chosen_id, chosen_lp, rank, [(top_id, top_lp), ...]), ...]."""
    # float64 keeps the hand-written values exact (the engine sends float32).
    return LogprobsLists(
        token_ids=np.array([[tid] + [t for t, _ in top] for tid, _, _, top in rows], dtype=np.int64),
        logprobs=np.array([[lp] + [l for _, l in top] for _, lp, _, top in rows], dtype=np.float64),
        ranks=np.array([rank for _, _, rank, _ in rows], dtype=np.int64),
    )


def test_sample_logprobs_trimmed_to_k_with_true_rank(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, logprobs=2)
    top = [(50, -0.1), (51, -0.5), (52, -1.0)]  # the engine sends 3 columns, the request asked for 2
    step1 = lp_rows([(51, -0.5, 2, top)])  # sampled token inside the top-k
    step2 = lp_rows([(99, -4.0, 17, top)])  # sampled token far outside the top-k
    proc.process_outputs([EngineCoreOutput("r", [51], new_logprobs=step1)])
    [ro] = proc.process_outputs([EngineCoreOutput("r", [99], new_logprobs=step2)]).request_outputs
    c = ro.outputs[0]
    assert c.logprobs[0] == {
        51: Logprob(-0.5, 2, tokenizer.decode([51])),
        50: Logprob(-0.1, 1, tokenizer.decode([50])),
    }
    assert list(c.logprobs[1]) == [99, 50, 51]  # sampled first, then the top-2
    # 99 is one byte of a multi-byte character that 51 does not complete: its text is "" (vLLM's rule),
    # not the U+FFFD that decoding it alone gives.
    assert tokenizer.decode([99]) == "\ufffd" and c.logprobs[1][99] == Logprob(-4.0, 17, "")
    assert c.logprobs[1][51].rank == 2
    assert c.cumulative_logprob == pytest.approx(-4.5)


def test_logprobs_zero_keeps_only_sampled_token(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, logprobs=0)
    [ro] = proc.process_outputs([EngineCoreOutput("r", [70], new_logprobs=lp_rows([(70, -0.3, 3, [(60, -0.1)])]))]).request_outputs
    assert ro.outputs[0].logprobs == [{70: Logprob(-0.3, 3, tokenizer.decode([70]))}]


def test_no_logprobs_requested(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc)
    [ro] = proc.process_outputs([EngineCoreOutput("r", [70])]).request_outputs
    assert ro.outputs[0].logprobs is None and ro.outputs[0].cumulative_logprob is None
    assert ro.prompt_logprobs is None


def test_detokenize_false_gives_no_text_and_no_decoded_tokens(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, logprobs=1, detokenize=False, stop=["a"])
    [ro] = proc.process_outputs([EngineCoreOutput("r", [70], new_logprobs=lp_rows([(70, -0.3, 1, [(70, -0.3)])]))]).request_outputs
    assert ro.outputs[0].text == "" and ro.outputs[0].logprobs == [{70: Logprob(-0.3, 1, None)}]


def test_prompt_logprobs_from_two_chunks(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, prompt_logprobs=1)
    # Positions 1..3 of the prompt [10, 11, 12, 13], in two chunks of a chunked prefill.
    chunk1 = lp_rows([(11, -2.0, 5, [(40, -0.2), (41, -0.3)])])
    chunk2 = lp_rows([(12, -1.0, 1, [(12, -1.0), (42, -1.5)]), (13, -3.0, 9, [(43, -0.1), (44, -0.2)])])
    first = proc.process_outputs([EngineCoreOutput("r", [], new_prompt_logprobs=chunk1)])
    assert first.request_outputs == []  # nothing to report until a token is generated
    [ro] = proc.process_outputs([EngineCoreOutput("r", [70], new_prompt_logprobs=chunk2)]).request_outputs
    d = tokenizer.decode
    assert ro.prompt_logprobs == [
        None,
        {11: Logprob(-2.0, 5, d([11])), 40: Logprob(-0.2, 1, d([40]))},
        {12: Logprob(-1.0, 1, d([12]))},
        {13: Logprob(-3.0, 9, d([13])), 43: Logprob(-0.1, 1, d([43]))},
    ]
    assert len(ro.prompt_logprobs) == len(PROMPT_IDS)


def test_prompt_logprobs_sent_once_in_delta(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA)
    chunk = lp_rows([(11, -2.0, 5, []), (12, -1.0, 1, []), (13, -3.0, 9, [])])
    [ro1] = proc.process_outputs([EngineCoreOutput("r", [70], new_prompt_logprobs=chunk)]).request_outputs
    [ro2] = proc.process_outputs([EngineCoreOutput("r", [71])]).request_outputs
    assert len(ro1.prompt_logprobs) == 4 and ro2.prompt_logprobs is None


@pytest.mark.parametrize(
    "reason, stop_reason, expected",
    [
        (FinishReason.STOP, None, "stop"),  # EOS
        (FinishReason.STOP, 7, "stop"),  # a stop token id
        (FinishReason.LENGTH, None, "length"),
        (FinishReason.ABORT, None, "abort"),
        (FinishReason.ERROR, None, "error"),
        (FinishReason.REPETITION, None, "repetition"),
    ],
)
def test_finish_reason_and_stop_reason_passthrough(tokenizer, reason, stop_reason, expected):
    proc = OutputProcessor(tokenizer)
    add(proc)
    result = proc.process_outputs([EngineCoreOutput("r", [70, 71], finish_reason=reason, stop_reason=stop_reason)])
    [ro] = result.request_outputs
    assert ro.finished and ro.outputs[0].finish_reason == expected and ro.outputs[0].stop_reason == stop_reason
    assert ro.outputs[0].token_ids == [70, 71] and result.reqs_to_abort == []
    assert not proc.has_unfinished_requests()


def test_stop_token_is_kept_in_ids_but_not_in_text(tokenizer):
    for include, expected_text in [(False, tokenizer.decode([70])), (True, tokenizer.decode([70, 71]))]:
        proc = OutputProcessor(tokenizer)
        add(proc, stop_token_ids=[71], include_stop_str_in_output=include)
        [ro] = proc.process_outputs([EngineCoreOutput("r", [70, 71], finish_reason=FinishReason.STOP, stop_reason=71)]).request_outputs
        assert ro.outputs[0].token_ids == [70, 71] and ro.outputs[0].text == expected_text


def test_output_kinds_single_request(tokenizer):
    ids = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    results = {}
    for kind in RequestOutputKind:
        proc = OutputProcessor(tokenizer)
        add(proc, output_kind=kind)
        outs = []
        for k, t in enumerate(ids):
            fin = FinishReason.LENGTH if k == len(ids) - 1 else None
            outs += proc.process_outputs([EngineCoreOutput("r", [t], finish_reason=fin, num_cached_tokens=2)]).request_outputs
        results[kind] = outs
    cum, delta, final = results[RequestOutputKind.CUMULATIVE], results[RequestOutputKind.DELTA], results[RequestOutputKind.FINAL_ONLY]
    assert len(cum) == len(delta) == len(ids) and len(final) == 1
    assert cum[-1].outputs[0].text == final[0].outputs[0].text == "The quick brown fox"
    assert cum[-1].outputs[0].token_ids == final[0].outputs[0].token_ids == ids
    assert [o.outputs[0].token_ids for o in delta] == [[t] for t in ids]
    assert "".join(o.outputs[0].text for o in delta) == "The quick brown fox"
    assert [o.finished for o in cum] == [False] * (len(ids) - 1) + [True]
    assert final[0].num_cached_tokens == 2 and final[0].prompt_token_ids == PROMPT_IDS and final[0].prompt == "p"


def test_parent_request_makes_children():
    sp = SamplingParams(n=3, seed=5, prompt_logprobs=1)
    parent = ParentRequest("req", sp)
    children = parent.make_child_requests(EngineCoreRequest("req", PROMPT_IDS, sp, eos_token_id=0, priority=2))
    assert [c.request_id for c in children] == ["0_req", "1_req", "2_req"]
    assert [c.sampling_params.seed for c in children] == [5, 6, 7]
    assert all(c.sampling_params.n == 1 and c.priority == 2 for c in children)
    assert [c.sampling_params.prompt_logprobs for c in children] == [1, None, None]
    unseeded = ParentRequest("u", SamplingParams(n=2)).make_child_requests(
        EngineCoreRequest("u", PROMPT_IDS, SamplingParams(n=2), eos_token_id=0)
    )
    assert [c.sampling_params.seed for c in unseeded] == [None, None]


def test_children_params_are_validated_copies():
    """Children 1..n-1 are copies of child 0 (not re-validated), yet equal to what validating each gives,
    independent objects, and a seed past int64 at any index is refused as validation refuses it."""
    sp = SamplingParams(n=4, seed=9, logprobs=2, prompt_logprobs=1, stop="x", temperature=0.5)
    parent = ParentRequest("req", sp)
    children = [c.sampling_params for c in parent.make_child_requests(EngineCoreRequest("req", PROMPT_IDS, sp, eos_token_id=0))]
    assert children == [parent.child_sampling_params(i) for i in range(4)]
    assert len({id(c) for c in children} | {id(sp)}) == 5
    children[2].seed = 0
    assert children[1].seed == 10 and children[3].seed == 12 and sp.seed == 9
    top = 2**63 - 1
    near = SamplingParams(n=3, seed=top - 1)  # children 0 and 1 fit, child 2's seed does not
    with pytest.raises(ValueError, match="seed must fit in 64 bits"):
        ParentRequest("big", near).make_child_requests(EngineCoreRequest("big", PROMPT_IDS, near, eos_token_id=0))


def add_parent(proc, kind, **params):
    sp = SamplingParams(n=2, max_tokens=100, output_kind=kind, **params)
    parent = ParentRequest("req", sp)
    for i, child in enumerate(parent.make_child_requests(EngineCoreRequest("req", PROMPT_IDS, sp, eos_token_id=0))):
        proc.add_request(child, prompt="p", parent_req=parent, index=i)
    return parent


# Steps: child 1 first, then both, then child 0 finishes, then child 1 finishes.
N2_STEPS = [
    [("1_req", [70], None)],
    [("0_req", [71], None), ("1_req", [72], None)],
    [("0_req", [73], FinishReason.LENGTH)],
    [("1_req", [74], FinishReason.STOP)],
]


def run_n2(tokenizer, kind, **params):
    proc = OutputProcessor(tokenizer)
    add_parent(proc, kind, **params)
    per_step = []
    for step in N2_STEPS:
        outs = [EngineCoreOutput(rid, ids, finish_reason=fin) for rid, ids, fin in step]
        per_step.append(proc.process_outputs(outs).request_outputs)
    assert not proc.has_unfinished_requests() and proc.get_num_unfinished_requests() == 0
    return per_step


def test_n2_cumulative(tokenizer):
    per_step = run_n2(tokenizer, RequestOutputKind.CUMULATIVE)
    assert all(len(s) == 1 and s[0].request_id == "req" for s in per_step)  # one output per step
    ids = [[c.token_ids for c in s[0].outputs] for s in per_step]
    assert ids == [[[], [70]], [[71], [70, 72]], [[71, 73], [70, 72]], [[71, 73], [70, 72, 74]]]
    assert [c.index for c in per_step[0][0].outputs] == [0, 1]
    assert [s[0].finished for s in per_step] == [False, False, False, True]
    final = per_step[-1][0].outputs
    assert [c.finish_reason for c in final] == ["length", "stop"]
    assert final[0].text == tokenizer.decode([71, 73])


def test_n2_delta(tokenizer):
    per_step = run_n2(tokenizer, RequestOutputKind.DELTA)
    got = [[(c.index, c.token_ids) for c in s[0].outputs] for s in per_step]
    assert got == [[(1, [70])], [(0, [71]), (1, [72])], [(0, [73])], [(1, [74])]]
    assert [s[0].finished for s in per_step] == [False, False, False, True]
    assert per_step[2][0].outputs[0].finish_reason == "length"


def test_n2_final_only(tokenizer):
    per_step = run_n2(tokenizer, RequestOutputKind.FINAL_ONLY)
    assert [len(s) for s in per_step] == [0, 0, 0, 1]
    [ro] = per_step[-1]
    assert ro.finished and ro.request_id == "req"
    assert [(c.index, c.token_ids, c.finish_reason) for c in ro.outputs] == [(0, [71, 73], "length"), (1, [70, 72, 74], "stop")]


def test_n2_prompt_logprobs_from_first_child(tokenizer):
    proc = OutputProcessor(tokenizer)
    add_parent(proc, RequestOutputKind.FINAL_ONLY, prompt_logprobs=0)
    chunk = lp_rows([(11, -2.0, 5, []), (12, -1.0, 1, []), (13, -3.0, 9, [])])
    proc.process_outputs([EngineCoreOutput("0_req", [70], new_prompt_logprobs=chunk, finish_reason=FinishReason.LENGTH)])
    [ro] = proc.process_outputs([EngineCoreOutput("1_req", [71], finish_reason=FinishReason.LENGTH)]).request_outputs
    assert ro.prompt_logprobs[0] is None and list(ro.prompt_logprobs[3]) == [13]


def test_abort_parent_expands_to_children(tokenizer):
    proc = OutputProcessor(tokenizer)
    add_parent(proc, RequestOutputKind.CUMULATIVE)
    add(proc, "solo")
    assert proc.get_num_unfinished_requests() == 3
    assert sorted(proc.abort_requests(["req"])) == ["0_req", "1_req"]
    assert proc.abort_requests(["solo", "missing"]) == ["solo"]
    assert not proc.has_unfinished_requests()
    # Late outputs of aborted requests are ignored.
    assert proc.process_outputs([EngineCoreOutput("0_req", [70])]).request_outputs == []


def test_aborting_a_parent_or_its_children_one_by_one_forgets_everything(tokenizer):
    """A parent of many children: aborted whole, or child by child (the last one forgets the parent),
    after some children finished normally."""
    n = 4096
    proc = OutputProcessor(tokenizer)
    parent = ParentRequest("big", SamplingParams(n=n, max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY))
    request = EngineCoreRequest("big", [1, 2, 3], parent.sampling_params, eos_token_id=None, arrival_time=0.0)
    for index, child in enumerate(parent.make_child_requests(request)):
        proc.add_request(child, None, parent, index)
    assert len(proc.abort_requests(["big"])) == n and not proc.has_unfinished_requests()
    assert proc.parent_requests == {}

    parent = ParentRequest("p", SamplingParams(n=3, max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY))
    request = EngineCoreRequest("p", [1, 2, 3], parent.sampling_params, eos_token_id=None, arrival_time=0.0)
    for index, child in enumerate(parent.make_child_requests(request)):
        proc.add_request(child, None, parent, index)
    proc.process_outputs([EngineCoreOutput("0_p", [7], finish_reason=FinishReason.LENGTH)])
    assert proc.abort_requests(["1_p"]) == ["1_p"] and "p" in proc.parent_requests
    assert proc.abort_requests(["2_p"]) == ["2_p"] and proc.parent_requests == {}
    assert not proc.has_unfinished_requests()


@pytest.mark.parametrize("how", ["finished", "aborted", "children aborted"])
def test_a_done_parent_and_its_children_are_freed_without_the_garbage_collector(tokenizer, how):
    """No reference cycle is left between a parent and its children's states once the parent is done, so
    reference counting frees them (with the collector off) instead of a later full collection."""
    proc = OutputProcessor(tokenizer)
    parent = add_parent(proc, RequestOutputKind.FINAL_ONLY)
    refs = [weakref.ref(parent)] + [weakref.ref(state) for state in parent.child_states.values()]
    del parent
    gc.disable()
    try:
        if how == "finished":
            proc.process_outputs([EngineCoreOutput("0_req", [70], finish_reason=FinishReason.LENGTH)])
            proc.process_outputs([EngineCoreOutput("1_req", [71], finish_reason=FinishReason.STOP)])
        elif how == "aborted":
            assert sorted(proc.abort_requests(["req"])) == ["0_req", "1_req"]
        else:
            assert proc.abort_requests(["0_req"]) == ["0_req"] and proc.abort_requests(["1_req"]) == ["1_req"]
        assert not proc.has_unfinished_requests() and proc.parent_requests == {}
        assert [ref() for ref in refs] == [None, None, None]
    finally:
        gc.enable()


def test_per_request_wire_structs_are_not_tracked_by_the_garbage_collector():
    """A step makes an EngineCoreOutput (and a LogprobsLists) per running request, and every request holds its
    SamplingParams for its whole life: none of them adds to the collector's generations."""
    lists = lp_rows([(1, -0.5, 1, [])])
    params = SamplingParams(n=2, seed=3, stop=["x"], logit_bias={4: 1.0}, bad_words_token_ids=[[5]])
    assert not gc.is_tracked(EngineCoreOutput("r", [1, 2], new_logprobs=lists))
    assert not gc.is_tracked(lists) and not gc.is_tracked(params) and not gc.is_tracked(params.clone(seed=4))
    assert not gc.is_tracked(EngineCoreRequest("r", [1, 2], params, eos_token_id=0))


def test_duplicate_request_id_rejected(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc)
    with pytest.raises(ValueError, match="request_id"):
        add(proc)


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_routed_experts_follow_the_output_kind(tokenizer, kind):
    proc = OutputProcessor(tokenizer)
    add(proc, return_routed_experts=True, output_kind=kind)
    add(proc, req_id="plain", output_kind=kind)
    rows = lambda start, n: np.arange(start, start + n, dtype=np.int32).reshape(n, 1, 1).repeat(2, 1)  # [n, 2, 1]
    # Prompt of 4 tokens: the first output carries the prompt's rows, each decode step one more row.
    steps = [(rows(0, 4), [51], None), (rows(4, 1), [52], None), (rows(5, 1), [53], FinishReason.LENGTH)]
    seen = []
    for routed, ids, finish in steps:
        res = proc.process_outputs([
            EngineCoreOutput("r", ids, new_routed_experts=routed, finish_reason=finish),
            EngineCoreOutput("plain", ids, finish_reason=finish),
        ]).request_outputs
        by_id = {ro.request_id: ro.outputs[0] for ro in res}
        if "plain" in by_id:
            assert by_id["plain"].routed_experts is None
        if "r" in by_id:
            seen.append(by_id["r"].routed_experts)
    full = rows(0, 6).tolist()
    if kind == RequestOutputKind.DELTA:
        assert seen == [full[:4], full[4:5], full[5:6]]
    elif kind == RequestOutputKind.CUMULATIVE:
        assert seen == [full[:4], full[:5], full]
    else:
        assert seen == [full]


def test_routed_experts_prompt_start_leaves_out_the_first_prompt_rows(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, return_routed_experts=True, routed_experts_prompt_start=3, output_kind=RequestOutputKind.DELTA)
    rows = lambda start, n: np.arange(start, start + n, dtype=np.int32).reshape(n, 1, 1)  # [n, 1, 1]
    # The prompt's rows arrive over two chunks (chunked prefill: 2 then 2), then one per decode step.
    steps = [(rows(0, 2), [], None), (rows(2, 2), [51], None), (rows(4, 1), [52], FinishReason.LENGTH)]
    seen = []
    for routed, ids, finish in steps:
        for ro in proc.process_outputs([EngineCoreOutput("r", ids, new_routed_experts=routed,
                                                         finish_reason=finish)]).request_outputs:
            seen += ro.outputs[0].routed_experts
    assert seen == rows(3, 2).tolist()  # rows 0..2 (the first 3 prompt positions) left out


def test_partial_utf8_token_texts_are_completed_by_their_context(tokenizer):
    """A character spelled by several byte tokens: each token's decoded_token is "" until the one that
    completes it, which carries the whole character (as vLLM's logprobs report them), in sample and in
    prompt logprobs, also when the bytes arrive over several steps."""
    ids = tokenizer.encode("a\U0001F600b", add_special_tokens=False)  # "a", three byte tokens, "b"
    assert len(ids) == 5 and all(tokenizer.decode([t]).endswith("\ufffd") for t in ids[1:4])
    proc = OutputProcessor(tokenizer)
    add(proc, logprobs=0)
    texts = []
    for t in ids:  # one token a step
        [ro] = proc.process_outputs([EngineCoreOutput("r", [t], new_logprobs=lp_rows([(t, -1.0, 1, [])]))]).request_outputs
    texts = [next(iter(pos.values())).decoded_token for pos in ro.outputs[0].logprobs]
    assert texts == ["a", "", "", "\U0001F600", "b"]
    # Prompt logprobs: one chunk of positions 1.. (position 0, the first token, has none).
    proc = OutputProcessor(tokenizer)
    proc.add_request(EngineCoreRequest("p", ids, SamplingParams(max_tokens=1, prompt_logprobs=0), eos_token_id=0), prompt="p")
    rows = lp_rows([(t, -1.0, 1, []) for t in ids[1:]])
    [ro] = proc.process_outputs([EngineCoreOutput("p", [7], new_prompt_logprobs=rows,
                                                  finish_reason=FinishReason.LENGTH)]).request_outputs
    assert [None if p is None else next(iter(p.values())).decoded_token for p in ro.prompt_logprobs] == [
        None, "", "", "\U0001F600", "b"]

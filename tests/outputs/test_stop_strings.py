"""Stop strings in the OutputProcessor: found in one step or split across steps, truncation, DELTA hold-back."""

import pytest

from engine.output_processor import OutputProcessor
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.stop_strings import find_stop_string
from engine.wire import EngineCoreOutput, EngineCoreRequest, FinishReason


def run(tokenizer, text, chunk_size=1, finish_at_end=None, **params):
    """Feeds `text`'s tokens to one request, chunk_size per step; returns (outputs, reqs_to_abort)."""
    sp = SamplingParams(max_tokens=1000, **params)
    proc = OutputProcessor(tokenizer)
    prompt_ids = tokenizer.encode("Hello", add_special_tokens=False)
    proc.add_request(EngineCoreRequest("r", prompt_ids, sp, eos_token_id=0), prompt="Hello")
    ids = tokenizer.encode(text, add_special_tokens=False)
    outputs, aborts = [], []
    for i in range(0, len(ids), chunk_size):
        last = i + chunk_size >= len(ids)
        out = EngineCoreOutput("r", ids[i : i + chunk_size], finish_reason=finish_at_end if last else None)
        result = proc.process_outputs([out])
        outputs += result.request_outputs
        aborts += result.reqs_to_abort
        if not proc.has_unfinished_requests():
            break
    return outputs, aborts, proc


def test_find_stop_string_only_counts_matches_ending_in_new_text():
    assert find_stop_string("abcSTOPdef", 3, ["STOP"], False) is None
    assert find_stop_string("abcSTOPdef", 6, ["STOP"], False) == ("STOP", 3)
    assert find_stop_string("abcSTOPdef", 6, ["STOP"], True) == ("STOP", 7)
    # Split: only "OP" is new, the rest came in the previous step.
    assert find_stop_string("abcSTOP", 2, ["STOP"], False) == ("STOP", 3)


@pytest.mark.parametrize("chunk_size", [1, 100])
def test_stop_string_hit_truncates_and_aborts(tokenizer, chunk_size):
    outputs, aborts, proc = run(tokenizer, "The quick brown fox jumps over the lazy dog.", chunk_size, stop=["fox"])
    final = outputs[-1]
    assert final.finished and final.outputs[0].text == "The quick brown "
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "fox"
    assert aborts == ["r"]  # the engine core still runs it and must free its KV
    assert not proc.has_unfinished_requests()


def test_stop_string_split_across_steps(tokenizer):
    text = "The quick brown fox jumps"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    # A stop string made of the tail of one token and the head of the next.
    k = next(k for k in range(len(pieces) - 1) if len(pieces[k]) > 1 and len(pieces[k + 1]) > 1)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    outputs, aborts, _ = run(tokenizer, text, 1, stop=[stop])
    assert outputs[-1].outputs[0].text == "".join(pieces[:k]) + pieces[k][:-2]
    assert outputs[-1].outputs[0].stop_reason == stop and aborts == ["r"]


def test_include_stop_str_in_output(tokenizer):
    outputs, _, _ = run(tokenizer, "The quick brown fox jumps over", 1, stop=["brown f"], include_stop_str_in_output=True)
    assert outputs[-1].outputs[0].text == "The quick brown f"
    assert outputs[-1].outputs[0].stop_reason == "brown f"


def test_several_stop_strings_earliest_wins(tokenizer):
    # All in one step: "dog" is listed first but "quick" appears earlier in the text.
    outputs, _, _ = run(tokenizer, "The quick brown fox jumps over the lazy dog.", 100, stop=["dog", "fox", "quick"])
    assert outputs[-1].outputs[0].text == "The "
    assert outputs[-1].outputs[0].stop_reason == "quick"


def test_stop_string_overrides_engine_finish_in_same_step(tokenizer):
    outputs, aborts, _ = run(tokenizer, "The quick brown fox", 100, finish_at_end=FinishReason.LENGTH, stop=["quick"])
    assert outputs[-1].outputs[0].finish_reason == "stop" and outputs[-1].outputs[0].text == "The "
    assert aborts == []  # the engine already finished it


def test_no_stop_string_hit_keeps_engine_finish(tokenizer):
    text = "The quick brown fox"
    outputs, aborts, _ = run(tokenizer, text, 1, finish_at_end=FinishReason.LENGTH, stop=["zebra"])
    assert outputs[-1].outputs[0].text == text and outputs[-1].outputs[0].finish_reason == "length"
    assert aborts == []


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_streaming_holds_back_possible_stop_string_start(tokenizer, kind):
    stop = "brown fox!"  # never completed: "brown fox" is followed by " jumps"
    text = "The quick brown fox jumps"
    outputs, _, _ = run(tokenizer, text, 1, finish_at_end=FinishReason.LENGTH, stop=[stop], output_kind=kind)
    seen, num_tokens = "", 0
    for ro in outputs:
        c = ro.outputs[0]
        seen = seen + c.text if kind == RequestOutputKind.DELTA else c.text
        num_tokens = num_tokens + len(c.token_ids) if kind == RequestOutputKind.DELTA else len(c.token_ids)
        if not ro.finished:
            # The last len(stop) - 1 characters generated so far stay hidden.
            generated = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:num_tokens])
            assert seen == generated[: max(0, len(generated) - (len(stop) - 1))]
    assert outputs[-1].finished and seen == text


def test_delta_never_shows_text_later_cut_by_stop(tokenizer):
    text = "The quick brown fox jumps"
    stop = "fox jumps"
    outputs, _, _ = run(tokenizer, text, 1, stop=[stop], output_kind=RequestOutputKind.DELTA)
    streamed = [ro.outputs[0].text for ro in outputs]
    assert "".join(streamed) == "The quick brown "
    # Every piece shown before the end lies before the stop string: nothing is taken back.
    assert outputs[-1].finished and outputs[-1].outputs[0].stop_reason == stop

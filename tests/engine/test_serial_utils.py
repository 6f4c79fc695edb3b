"""MsgpackEncoder/MsgpackDecoder: round trips, arrays inline and as frames, and frame 0 never overwritten in flight."""

import numpy as np
import pytest
import torch
import zmq

from engine.core.stats import SchedulerStats
from engine.sampling_params import SamplingParams
from engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from engine.wire import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
    UtilityOutput,
)


def _logprobs(n: int, k: int, seed: int = 0) -> LogprobsLists:
    rng = np.random.default_rng(seed)
    return LogprobsLists(
        rng.integers(0, 1000, (n, k + 1)).astype(np.int64),
        rng.standard_normal((n, k + 1)).astype(np.float32),
        rng.integers(1, 50, n).astype(np.int64),
    )


def test_outputs_round_trip_with_arrays_inline_and_as_frames():
    small, large = _logprobs(1, 2), _logprobs(300, 5, seed=1)  # 24 bytes vs ~14 KB
    outputs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput("a", [7], new_logprobs=small),
            EngineCoreOutput("b", [], new_prompt_logprobs=large, finish_reason=FinishReason.ERROR, stop_reason="bad"),
        ],
        timestamp=1.5,
        finished_requests={"b"},
        scheduler_stats=SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25),
        engine_index=3,
    )
    frames = MsgpackEncoder().encode(outputs)
    assert len(frames) == 4  # msgpack + the large token_ids, logprobs and ranks arrays
    got = MsgpackDecoder(EngineCoreOutputs).decode([bytes(f) for f in frames])
    a, b = got.outputs
    assert (a.request_id, a.new_token_ids, b.finish_reason, b.stop_reason) == ("a", [7], FinishReason.ERROR, "bad")
    for sent, received in [(small, a.new_logprobs), (large, b.new_prompt_logprobs)]:
        for name in ("token_ids", "logprobs", "ranks"):
            want, have = getattr(sent, name), getattr(received, name)
            assert have.dtype == want.dtype and have.shape == want.shape
            np.testing.assert_array_equal(have, want)
    assert got.finished_requests == {"b"} and got.engine_index == 3
    assert got.scheduler_stats.num_running_reqs == 2 and got.scheduler_stats.kv_cache_usage == 0.25


def test_request_and_utility_round_trip():
    request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(temperature=0.5, logprobs=2, stop=["x"]), 0, priority=4)
    got = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(request))
    assert got.prompt_token_ids == [1, 2, 3] and got.priority == 4
    assert got.sampling_params.temperature == 0.5 and got.sampling_params.stop == ["x"]

    answer = EngineCoreOutputs(utility_output=UtilityOutput(9, result={"ok": True, "arr": np.arange(100)}))
    got = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(answer))
    assert got.utility_output.call_id == 9 and got.utility_output.result["ok"] is True
    np.testing.assert_array_equal(got.utility_output.result["arr"], np.arange(100))


@pytest.mark.parametrize("shape", [(0,), (3,), (64, 33)])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_, np.float16])
def test_numpy_arrays_any_size_and_layout(shape, dtype):
    arr = (np.arange(int(np.prod(shape))) % 3).astype(dtype).reshape(shape)
    if arr.ndim == 2:
        arr = arr[:, 1::2]  # a non-contiguous view
    got = MsgpackDecoder().decode(MsgpackEncoder().encode({"x": arr}))["x"]
    assert got.dtype == arr.dtype and got.shape == arr.shape
    np.testing.assert_array_equal(got, arr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("numel", [2, 4096])
def test_cpu_tensors(dtype, numel):
    t = torch.arange(numel).to(dtype).reshape(2, -1)
    frames = MsgpackEncoder().encode([t])
    assert len(frames) == (2 if t.nbytes > 256 else 1)
    [got] = MsgpackDecoder().decode(frames)
    assert isinstance(got, torch.Tensor) and got.dtype == dtype
    assert torch.equal(got, t)


def _payload(i: int) -> dict:
    # ~100 KB of msgpack in frame 0 (large enough that pyzmq shares it instead of copying),
    # every byte depending on i, plus one array frame.
    return {"i": i, "blob": bytes([i % 251]) * 100_000, "arr": np.full(1000, i, np.int64)}


def _check(i: int, got: dict) -> None:
    assert got["i"] == i, f"message {i} arrived as message {got['i']}"
    assert got["blob"] == bytes([i % 251]) * 100_000, f"frame 0 of message {i} was overwritten in flight"
    assert (got["arr"] == i).all()


def _push_pull(address: str):
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(address)
    push = ctx.socket(zmq.PUSH)
    push.connect(address)
    return ctx, push, pull


@pytest.mark.parametrize("transport", ["inproc", "ipc"])
def test_reused_encoder_never_overwrites_a_frame_in_flight(tmp_path, transport):
    # Over inproc, queued messages keep pointing at the sender's memory until received, so
    # sending all messages before receiving any makes a reused frame-0 buffer show up as
    # corruption deterministically; ipc exercises a real IO thread.
    address = "inproc://serial-test" if transport == "inproc" else f"ipc://{tmp_path}/serial-test"
    ctx, push, pull = _push_pull(address)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder()
    num_messages = 50
    try:
        for i in range(num_messages):
            encoder.send(push, _payload(i))
        for i in range(num_messages):
            _check(i, decoder.decode(pull.recv_multipart(copy=False)))
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def test_the_reuse_check_detects_an_untracked_buffer():
    # The check above is sensitive: sending encode()'s frames zero-copy without tracking
    # frame 0 (what send() exists to prevent) corrupts earlier messages.
    ctx, push, pull = _push_pull("inproc://serial-untracked")
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder()
    try:
        for i in range(3):
            push.send_multipart(encoder.encode(_payload(i)), copy=False)
        with pytest.raises(AssertionError, match="overwritten in flight|arrived as message"):
            for i in range(3):
                _check(i, decoder.decode(pull.recv_multipart(copy=False)))
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def test_routed_experts_round_trip():
    routed = np.arange(3 * 2 * 2, dtype=np.int32).reshape(3, 2, 2)  # [tokens, moe_layers, top_k]
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    back = dec.decode(enc.encode(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [7], new_routed_experts=routed)])))
    got = back.outputs[0].new_routed_experts
    assert got.dtype == np.int32 and got.shape == (3, 2, 2) and np.array_equal(got, routed)
    assert dec.decode(enc.encode(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [7])]))).outputs[0].new_routed_experts is None

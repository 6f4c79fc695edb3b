"""The analytic FLOPs/bytes estimate against a hand calculation, and the scheduler's StepWork that feeds it."""

import msgspec
import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.stats import SchedulerStats, StepWork
from engine.metrics.flops import ModelShape, StepCostEstimator, estimate_step_cost
from engine.sampling_params import SamplingParams
from engine.wire import EngineCoreOutputs

HF_CONFIG = {
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "intermediate_size": 16,
    "vocab_size": 32,
    "tie_word_embeddings": False,
}


def test_step_work_closed_form_matches_brute_force():
    for c in range(7):
        for n in range(1, 6):
            work = StepWork()
            work.add_row(c, n, samples=False)
            assert work.attn_context_sum == sum(pos + 1 for pos in range(c, c + n))
            assert work.kv_context_sum == c + n
            assert (work.num_prefill_tokens, work.num_decode_tokens) == ((n, 0) if n > 1 else (0, 1))


def test_estimate_matches_hand_calculation():
    shape = ModelShape.from_hf_config(HF_CONFIG)
    # Per layer: q,o 2*8*(2*4)=128; k,v 2*8*(1*4)=64; gate/up/down 3*8*16=384.
    assert shape.layer_linear_params == 576
    assert shape.kv_elems_per_token == 2 * 2 * 1 * 4  # layers * (K,V) * kv_heads * head_dim

    work = StepWork(num_steps=1)
    work.add_row(0, 3, samples=True)  # a whole 3-token prompt: keys 1+2+3 = 6
    work.add_row(5, 1, samples=True)  # a decode at position 5: 6 keys
    work.add_row(4, 2, samples=False)  # a mid-prompt chunk at 4..5: keys 5+6 = 11
    assert (work.num_reqs, work.num_prefill_tokens, work.num_decode_tokens) == (3, 5, 1)
    assert (work.num_sampling_reqs, work.attn_context_sum, work.kv_context_sum) == (2, 23, 15)

    cost = estimate_step_cost(shape, work, dtype_bytes=2)
    linear = 2 * 2 * 576 * 6  # 2 * layers * params * tokens = 13824
    attention = 4 * 2 * 2 * 4 * 23  # 4 * layers * heads * head_dim * attn_context_sum = 1472
    unembedding = 2 * 8 * 32 * 2  # 2 * hidden * vocab * sampling rows = 1024
    assert cost.flops == linear + attention + unembedding == 16320

    weights = (2 * 576 + 8 * 32) * 2  # layer matrices + unembedding, bf16 = 2816
    embedding_rows = 6 * 8 * 2  # untied: one row per token = 96
    kv_read = 15 * 16 * 2  # kv_context_sum * kv elems per token * 2 bytes = 480
    assert cost.read_bytes == weights + embedding_rows + kv_read == 3392
    assert cost.write_bytes == 6 * 16 * 2 == 192  # every token writes its K and V

    half = estimate_step_cost(shape, work, dtype_bytes=2, world_size=2)
    assert (half.flops, half.read_bytes, half.write_bytes) == (8160, 1696, 96)
    tied = estimate_step_cost(ModelShape.from_hf_config({**HF_CONFIG, "tie_word_embeddings": True}), work, 2)
    assert tied.read_bytes == 3392 - 96


def test_shape_defaults_head_dim_and_kv_heads():
    shape = ModelShape.from_hf_config({k: v for k, v in HF_CONFIG.items() if k not in ("head_dim", "num_key_value_heads")})
    assert (shape.head_dim, shape.num_kv_heads) == (4, 2)


def test_estimator_from_engine_config(tiny_checkpoint):
    from engine.engine_args import create_engine_config

    config = create_engine_config(model=tiny_checkpoint(), device="cpu", dtype="bfloat16", max_model_len=64)
    estimator = StepCostEstimator.from_engine_config(config)
    assert estimator.dtype_bytes == 2 and estimator.shape.num_layers == 2
    assert estimator.estimate(StepWork()).flops == 0


def _request(req_id, num_prompt_tokens, max_tokens=4):
    return Request(req_id, list(range(num_prompt_tokens)), SamplingParams(max_tokens=max_tokens), None)


def test_scheduler_reports_each_step_work():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8), CacheConfig(block_size=4), 64, 32)
    sched.add_request(_request("a", 12))
    sched.schedule()  # "a" 0..7: a chunk that does not sample
    work = sched.make_stats().step_work
    assert (work.num_steps, work.num_reqs, work.num_prefill_tokens, work.num_sampling_reqs) == (1, 1, 8, 0)
    assert work.attn_context_sum == 8 * 9 // 2 and work.kv_context_sum == 8

    sched.add_request(_request("b", 1))
    sched.schedule()  # "a" 8..11 reaches its end and samples; "b" is a one-token prompt
    work = sched.make_stats().step_work
    assert (work.num_reqs, work.num_prefill_tokens, work.num_decode_tokens, work.num_sampling_reqs) == (2, 4, 1, 2)
    assert work.attn_context_sum == (9 + 10 + 11 + 12) + 1
    assert work.kv_context_sum == 12 + 1

    assert sched.make_stats().step_work == StepWork()  # reset by each make_stats()


def test_scheduler_stats_cross_the_wire():
    work = StepWork(num_steps=1, num_reqs=2, num_decode_tokens=2, attn_context_sum=9, kv_context_sum=9)
    outputs = EngineCoreOutputs(scheduler_stats=SchedulerStats(num_running_reqs=2, step_work=work))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(outputs), type=EngineCoreOutputs)
    assert decoded.scheduler_stats == outputs.scheduler_stats


@pytest.mark.parametrize("dtype, expected", [("float32", 4), ("float16", 2)])
def test_estimator_dtype(tiny_checkpoint, dtype, expected):
    from engine.engine_args import create_engine_config

    config = create_engine_config(model=tiny_checkpoint(), device="cpu", dtype=dtype, max_model_len=64)
    assert StepCostEstimator.from_engine_config(config).dtype_bytes == expected

"""The host's per-step Python at ~256 decode rows, part by part, without a model: steadier numbers than host_step.py.

Two parts, each timed per step (median over the steps of --rounds rounds):

    scheduler  Scheduler.schedule and update_from_output of 256 running requests (16 prompts x 16 samples
               of 512 tokens, prefix caching on, block_size 16) in the async pattern the engine core runs:
               schedule step N+1, then update from step N (one sampled token per row, made up).
    frontend   OutputProcessor.process_outputs and StatLoggerManager.record_engine_outputs (as LLM runs
               them) for 16 parents x n=16 FINAL_ONLY children, detokenized, fed one token per child per
               step (with the step's scheduler stats) for max_tokens steps; the last step finishes them.

Hot loops over few objects: the engine, whose forward pass runs between these, sees them cost more
(host_step.py measures them there); compare trees with this, in interleaved runs.

Table on stdout, JSON at --json-out with `uptime` before and after.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import resolve_model, write_json  # noqa: E402

NUM_PROMPTS, N, PROMPT_LEN = 16, 16, 512


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def scheduler_part(num_steps: int) -> dict[str, list[float]]:
    from engine.config import CacheConfig, SchedulerConfig
    from engine.core.request import Request
    from engine.core.scheduler import Scheduler
    from engine.sampling_params import SamplingParams
    from engine.worker.runner_output import ModelRunnerOutput

    sched = Scheduler(SchedulerConfig(max_num_seqs=NUM_PROMPTS * N), CacheConfig(block_size=16), 4096, 20000)
    rng = random.Random(0)
    for p in range(NUM_PROMPTS):
        prompt = [rng.randrange(3, 500) for _ in range(PROMPT_LEN)]
        for c in range(N):
            params = SamplingParams(max_tokens=4000, ignore_eos=True, temperature=1.0)
            sched.add_request(Request(f"{c}_{p}", prompt, params, eos_token_id=0))
    times: dict[str, list[float]] = {"schedule": [], "update_from_output": []}
    previous = None
    for _ in range(num_steps):
        start = time.perf_counter()
        out = sched.schedule()
        scheduled = time.perf_counter() - start
        if previous is not None:
            rows = list(previous.num_scheduled_tokens)
            runner_output = ModelRunnerOutput(rows, [[7 + i % 100] for i in range(len(rows))])
            start = time.perf_counter()
            sched.update_from_output(previous, runner_output)
            updated = time.perf_counter() - start
            if previous.total_num_scheduled_tokens == len(rows) == NUM_PROMPTS * N:  # decode steps only
                times["schedule"].append(scheduled)
                times["update_from_output"].append(updated)
        previous = out
    return times


def frontend_part(rounds: int, max_tokens: int) -> dict[str, list[float]]:
    from transformers import AutoTokenizer

    from engine.core.stats import SchedulerStats, StepWork
    from engine.engine_args import create_engine_config
    from engine.metrics.loggers import StatLoggerManager
    from engine.output_processor import OutputProcessor
    from engine.sampling_params import RequestOutputKind, SamplingParams
    from engine.wire import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason

    path = resolve_model("tiny-llama")
    config = create_engine_config(model=path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    times: dict[str, list[float]] = {"process_outputs": [], "record_engine_outputs": []}
    rng = random.Random(0)
    for r in range(rounds):
        processor = OutputProcessor(tokenizer)
        stat_loggers = StatLoggerManager(config, model_name="bench")
        child_ids = []
        for p in range(NUM_PROMPTS):
            params = SamplingParams(n=N, max_tokens=max_tokens, temperature=1.0, ignore_eos=True,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
            prompt = [rng.randrange(3, 500) for _ in range(PROMPT_LEN)]
            request = EngineCoreRequest(f"{r}-{p}", prompt, params, eos_token_id=0, arrival_time=time.time())
            for child in processor.add_user_request(request, None):
                stat_loggers.on_request_added(child.request_id, request.arrival_time, PROMPT_LEN, request.request_id,
                                              max_tokens, N)
                child_ids.append(child.request_id)
        for step in range(max_tokens):
            finish = FinishReason.LENGTH if step == max_tokens - 1 else None
            work = StepWork(num_steps=1)
            work.add_decode_rows(len(child_ids), len(child_ids) * (PROMPT_LEN + step + 1))
            stats = SchedulerStats(num_running_reqs=len(child_ids), kv_cache_usage=0.5, step_work=work)
            outputs = EngineCoreOutputs(
                outputs=[EngineCoreOutput(req_id, [rng.randrange(3, 500)], finish_reason=finish, num_cached_tokens=496)
                         for req_id in child_ids], timestamp=time.time(), scheduler_stats=stats)
            start = time.perf_counter()
            processed = processor.process_outputs(outputs.outputs, outputs.weight_version, outputs.lora_weight_versions)
            middle = time.perf_counter()
            stat_loggers.record_engine_outputs(outputs, stopped_req_ids=processed.reqs_to_abort)
            end = time.perf_counter()
            times["process_outputs"].append(middle - start)
            times["record_engine_outputs"].append(end - middle)
        assert not processor.has_unfinished_requests()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["scheduler", "frontend", "all"], default="all")
    p.add_argument("--steps", type=int, default=300, help="scheduler: engine steps")
    p.add_argument("--rounds", type=int, default=10, help="frontend: generates of max_tokens steps")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--note", default=None, help="free text kept in the JSON (what tree this is)")
    p.add_argument("--json-out", default="benchmarks/out/host_micro.json")
    args = p.parse_args()
    load_before = uptime()
    times: dict[str, list[float]] = {}
    if args.part in ("scheduler", "all"):
        times |= scheduler_part(args.steps)
    if args.part in ("frontend", "all"):
        times |= frontend_part(args.rounds, args.max_tokens)
    load_after = uptime()
    rows = {name: dict(median_us=1e6 * statistics.median(t), per_row_us=1e6 * statistics.median(t) / (NUM_PROMPTS * N),
                       steps=len(t)) for name, t in times.items()}
    print(f"\nhost per step, {NUM_PROMPTS * N} decode rows ({NUM_PROMPTS} prompts x n={N})")
    print(f"{'part':<24}{'us/step':>10}{'us/row':>9}{'steps':>7}")
    for name, row in rows.items():
        print(f"{name:<24}{row['median_us']:>10.1f}{row['per_row_us']:>9.2f}{row['steps']:>7}")
    print(f"load: before [{load_before}] after [{load_after}]")
    write_json(args.json_out, dict(benchmark="host_micro", note=args.note, parts=rows, load_before=load_before,
                                   load_after=load_after))


if __name__ == "__main__":
    main()

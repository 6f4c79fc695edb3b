"""Where an offline run's time goes: per-step host/GPU split by step kind, and the GPU kernels' totals.

Runs the offline workload (benchmarks/offline_throughput.py's defaults) through the in-process
LLM twice: once with timers around schedule / execute / update (one record per engine step,
summarised by step kind and batch size), once under torch.profiler (CUDA activity only) for
the kernels' total GPU time against the wall time. Prints both tables and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import make_workload, resolve_model, vocab_size_of, write_json  # noqa: E402

BATCH_BUCKETS = [(1, 1), (2, 8), (9, 32), (33, 64), (65, 128), (129, 192), (193, 256), (257, 10**9)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--shape", default=None, help="GPU: random-weight model of a published shape (see gpu_common.py)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024])
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-kernels", type=int, default=25)
    p.add_argument("--no-kernel-profile", action="store_true", help="skip the torch.profiler pass")
    p.add_argument("--num-loras", type=int, default=0,
                   help="serve this many random adapters (all projections), request i running adapter i %% K")
    p.add_argument("--lora-rank", type=int, default=16, help="--num-loras: the adapters' rank")
    p.add_argument("--json-out", default="benchmarks/out/step_profile.json")
    return p.parse_args()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _kind(sched) -> str:
    num_reqs = len(sched.num_scheduled_tokens)
    if num_reqs == 0:
        return "empty"
    if sched.total_num_scheduled_tokens == num_reqs:
        lo, hi = next(b for b in BATCH_BUCKETS if b[0] <= num_reqs <= b[1])
        return f"decode {lo}-{hi}" if lo != hi else f"decode {lo}"
    return "prefill/mixed"


def traced_run(llm, prompts, params, loras=None) -> tuple[list[dict], float]:
    """One timed generate() with timers around the core's schedule, execute and update.

    With async scheduling an engine step launches step N+1 and collects step N: 'execute' is
    the launch plus the wait for the previous step, and the record is the iteration's (its
    kind is the launched step's).
    """
    core = llm.engine_core
    records: list[dict] = []
    current: dict = {}
    schedule, update = core.scheduler.schedule, core.scheduler.update_from_output
    executor = core.executor
    run_names = ["launch_model", "finish_model"] if core.async_scheduling else ["execute_model"]
    runs = {name: getattr(executor, name) for name in run_names}

    def timed_schedule():
        t = time.perf_counter()
        out = schedule()
        current.update(kind=_kind(out), reqs=len(out.num_scheduled_tokens), tokens=out.total_num_scheduled_tokens,
                       schedule_ms=(time.perf_counter() - t) * 1e3, t0=t)
        return out

    def timed(run):
        def wrapper(arg):
            t = time.perf_counter()
            out = run(arg)
            current["execute_ms"] = current.get("execute_ms", 0.0) + (time.perf_counter() - t) * 1e3
            return out
        return wrapper

    def timed_update(sched, runner_out):
        t = time.perf_counter()
        out = update(sched, runner_out)
        now = time.perf_counter()
        if "kind" in current:  # an iteration that scheduled something
            current["update_ms"] = (now - t) * 1e3
            if records:  # the time from the previous step's end to this step's schedule: output handling, loop
                current["between_ms"] = (current["t0"] - records[-1]["t_end"]) * 1e3
            current["t_end"] = now
            records.append(dict(current))
        current.clear()
        return out

    core.scheduler.schedule = timed_schedule
    for name, run in runs.items():
        setattr(executor, name, timed(run))
    core.scheduler.update_from_output = timed_update
    try:
        _sync()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        _sync()
        elapsed = time.perf_counter() - start
    finally:
        core.scheduler.schedule, core.scheduler.update_from_output = schedule, update
        for name, run in runs.items():
            setattr(executor, name, run)
    return records, elapsed


def summarize_steps(records: list[dict]) -> list[dict]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[r["kind"]].append(r)
    rows = []
    order = ["prefill/mixed", "empty"] + [f"decode {lo}-{hi}" if lo != hi else f"decode {lo}" for lo, hi in BATCH_BUCKETS]
    for kind in order:
        rs = groups.get(kind)
        if not rs:
            continue
        n = len(rs)

        def mean(key):
            return sum(r.get(key, 0.0) for r in rs) / n

        step_ms = [r["schedule_ms"] + r["execute_ms"] + r["update_ms"] + r.get("between_ms", 0.0) for r in rs]
        rows.append({"kind": kind, "steps": n, "total_s": sum(step_ms) / 1e3, "mean_step_ms": sum(step_ms) / n,
                     "schedule_ms": mean("schedule_ms"), "execute_ms": mean("execute_ms"), "update_ms": mean("update_ms"),
                     "between_ms": mean("between_ms"), "mean_reqs": mean("reqs"), "mean_tokens": mean("tokens"),
                     "tok_per_step_s": sum(r["reqs"] for r in rs) / (sum(step_ms) / 1e3)})
    return rows


def kernel_profile(llm, prompts, params, top: int, loras=None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    _sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        _sync()
    wall = time.perf_counter() - start
    totals: dict[str, list[float]] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0) or 0.0
        if us > 0:
            totals[evt.key] = [us, evt.count]
    gpu_s = sum(v[0] for v in totals.values()) / 1e6
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return {"wall_s": wall, "gpu_kernel_s": gpu_s,
            "kernels": [{"name": name[:90], "total_s": v[0] / 1e6, "calls": v[1], "mean_us": v[0] / v[1],
                         "share": v[0] / 1e6 / gpu_s if gpu_s else 0.0} for name, v in ranked]}


def main() -> None:
    args = parse_args()
    from engine import LLM, SamplingParams

    if args.shape:
        from gpu_common import shape_checkpoint

        path = shape_checkpoint(args.shape)
    else:
        path = resolve_model(args.model)
    work = make_workload(args, vocab_size_of(path))
    extra = dict(gpu_memory_utilization=args.gpu_memory_utilization) if torch.cuda.is_available() else {}
    loras = None
    if args.num_loras:  # every adapter resident (max_loras = K): mixed batches, not paging
        import tempfile

        from gpu_common import random_peft_adapter

        from engine.lora.request import LoRARequest

        tmp = tempfile.mkdtemp(prefix="profile-lora-")
        adapters = [LoRARequest(f"bench-{i}", i + 1, random_peft_adapter(path, os.path.join(tmp, str(i)),
                                                                         args.lora_rank, seed=i))
                    for i in range(args.num_loras)]
        loras = [adapters[i % len(adapters)] for i in range(len(work))]
        extra.update(enable_lora=True, max_loras=args.num_loras, max_lora_rank=args.lora_rank)
    llm = LLM(path, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.input_len[1] + args.output_len[1], **extra)
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True) for _, n in work]
    llm.generate(prompts[:4], [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 4, use_tqdm=False,
                 lora_request=loras[:4] if loras else None)
    llm.reset_prefix_cache()

    records, elapsed = traced_run(llm, prompts, params, loras)
    out_tokens = sum(n for _, n in work)
    rows = summarize_steps(records)
    print(f"\n{args.shape or args.model}: {len(records)} steps, {elapsed:.2f} s, {out_tokens / elapsed:,.0f} output tok/s")
    print(f"{'kind':16} {'steps':>6} {'total s':>8} {'step ms':>8} {'sched':>7} {'exec':>7} {'update':>7} "
          f"{'between':>8} {'reqs':>6} {'tokens':>7}")
    for r in rows:
        print(f"{r['kind']:16} {r['steps']:6d} {r['total_s']:8.3f} {r['mean_step_ms']:8.3f} {r['schedule_ms']:7.3f} "
              f"{r['execute_ms']:7.3f} {r['update_ms']:7.3f} {r['between_ms']:8.3f} {r['mean_reqs']:6.1f} "
              f"{r['mean_tokens']:7.1f}")
    result = {"benchmark": "step_profile", "model": args.shape or args.model, "elapsed_s": elapsed,
              "output_tokens": out_tokens, "output_tok_per_s": out_tokens / elapsed, "steps": len(records),
              "by_kind": rows, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    if not args.no_kernel_profile and torch.cuda.is_available():
        llm.reset_prefix_cache()
        kp = kernel_profile(llm, prompts, params, args.top_kernels, loras)
        result["kernel_profile"] = kp
        print(f"\nprofiled run: wall {kp['wall_s']:.2f} s, GPU kernels {kp['gpu_kernel_s']:.2f} s "
              f"({kp['gpu_kernel_s'] / kp['wall_s']:.0%} busy)")
        print(f"{'kernel':90} {'total s':>8} {'calls':>7} {'mean us':>8} {'share':>6}")
        for k in kp["kernels"]:
            print(f"{k['name']:90} {k['total_s']:8.3f} {k['calls']:7d} {k['mean_us']:8.1f} {k['share']:6.1%}")
    llm.engine_core.shutdown()
    write_json(args.json_out, result)


if __name__ == "__main__":
    main()

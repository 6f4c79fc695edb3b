"""Decode time per step at several batch sizes against its floor (weights + KV bytes over measured copy bandwidth).

GPU only. Each batch of requests with `--context` prompt tokens runs `--decode-steps` decode
steps; the table gives the median runner time (GPU work up to the step's one host sync) and
engine-step time (plus scheduling and output handling) of the pure-decode steps, and the
floor: (weight bytes + KV bytes read) / measured device copy bandwidth.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import StepTimer, copy_bandwidth_bytes_per_s, median, shape_checkpoint, weight_bytes  # noqa: E402
from workload import write_json  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of decode steps per batch size")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--json-out", default="benchmarks/out/decode_latency.json")
    args = p.parse_args()

    from engine import LLM, SamplingParams

    path = shape_checkpoint(args.shape)
    bandwidth = copy_bandwidth_bytes_per_s()
    # Prefill chunks take ceil(batch * context / budget) steps; every request decodes that many
    # extra steps, so all of them decode together for at least --decode-steps steps.
    budget = args.max_num_batched_tokens
    max_extra = -(-max(args.batch_sizes) * args.context // budget) + 2
    llm = LLM(path, max_num_seqs=max(args.batch_sizes), max_model_len=args.context + args.decode_steps + max_extra + 8,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager, max_num_batched_tokens=budget)
    worker = llm.engine_core.executor.worker
    w_bytes = weight_bytes(worker.model)
    kv_per_token = worker.kv_bytes_per_block // llm.config.cache.block_size
    vocab = worker.hf_config.vocab_size
    timer = StepTimer(llm)
    rng = random.Random(0)
    rows = []
    for batch in [args.batch_sizes[0]] + args.batch_sizes:  # the first size twice: warm-up
        timer.records.clear()
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.context)]} for _ in range(batch)]
        extra = -(-batch * args.context // budget) + 2
        params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + extra, ignore_eos=True)
        if args.profile and len(rows) > 0 and batch in (1, max(args.batch_sizes)):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts, params, use_tqdm=False)
            print(f"--- profile, batch {batch} (whole generate: prefill + decode)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
            timer.records.clear()
        llm.generate(prompts, params, use_tqdm=False)
        steps = timer.decode_steps(batch)[2:]  # skip the first steps after prefill
        runner_s, step_s = median([r for r, _ in steps]), median([s for _, s in steps])
        mean_ctx = args.context + args.decode_steps / 2
        floor_s = (w_bytes + batch * mean_ctx * kv_per_token) / bandwidth
        rows.append(dict(batch=batch, runner_ms=runner_s * 1e3, step_ms=step_s * 1e3, floor_ms=floor_s * 1e3,
                         runner_over_floor=runner_s / floor_s, tok_per_s=batch / step_s, num_steps=len(steps)))
    rows = rows[1:]
    graphs = worker.model_runner.cuda_graphs
    result = dict(benchmark="decode_latency", shape=args.shape, context=args.context, gpu=torch.cuda.get_device_name(),
                  copy_bandwidth_GBps=bandwidth / 1e9, weight_bytes=w_bytes, kv_bytes_per_token=kv_per_token,
                  cuda_graphs=graphs is not None, rows=rows,
                  batch1_ms_per_token=next((r["step_ms"] for r in rows if r["batch"] == 1), None))
    print(f"\nDecode step time, {args.shape}, context ~{args.context}, {torch.cuda.get_device_name()}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, weights {w_bytes / 1e9:.2f} GB, CUDA graphs {graphs is not None}")
    print(f"{'batch':>6}{'runner ms':>11}{'step ms':>10}{'floor ms':>10}{'runner/floor':>14}{'tok/s':>10}")
    for r in rows:
        print(f"{r['batch']:>6}{r['runner_ms']:>11.3f}{r['step_ms']:>10.3f}{r['floor_ms']:>10.3f}"
              f"{r['runner_over_floor']:>14.2f}{r['tok_per_s']:>10.0f}")
    write_json(args.json_out, result)


if __name__ == "__main__":
    main()

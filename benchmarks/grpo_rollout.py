"""GRPO-shaped rollout: P prompts x n samples each, long shared prompts, prefix-cache hit rate and throughput.

GPU (or CPU with small sizes). The n samples of a prompt share its blocks: every sample but
the first can reuse floor((prompt_len - 1) / block_size) full blocks (the last prompt token
is always computed). Hit rate = prefix-cache hit tokens / those shareable tokens.

Issue 30's short-answer step shape (64 prompts x 16 samples, 512-token prompts, 32 new tokens):

    python benchmarks/grpo_rollout.py --max-tokens 32 --repeats 3 --floor --busy [--max-num-batched-tokens 2048]

--repeats times the rollout that many times (prefix cache reset before each; median reported);
--floor adds the schedule's floor (gpu_common.StepFloor over the steps of the last timed rollout);
--busy runs one more rollout under the profiler for the share of its wall time the GPU was busy
(the host's share is the rest: scheduling, input preparation, sampling bookkeeping, output handling), and
that busy time over the unprofiled rollout's wall time (the profiler slows the host, not the device).
Steps that prefill beside decode rows run eagerly (no CUDA graph) and cost the host a Python launch per
kernel, so the token budget sets how many such steps there are: --max-num-batched-tokens.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import shape_checkpoint  # noqa: E402
from workload import write_json  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the step's token budget (default: the engine's, as vLLM's LLM class: 16384 on H100/H200-class "
                        "GPUs, 2048 on CPU); run_gpu.sh's rl part also runs 2048")
    p.add_argument("--repeats", type=int, default=1, help="timed rollouts (median reported)")
    p.add_argument("--floor", action="store_true", help="GPU: the floor of the schedule the engine ran (StepFloor)")
    p.add_argument("--busy", action="store_true", help="GPU: one more rollout under the profiler, GPU busy share")
    p.add_argument("--json-out", default="benchmarks/out/grpo_rollout.json")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if (args.floor or args.busy) and not torch.cuda.is_available():
        p.error("--floor and --busy measure the GPU: they need CUDA")

    from engine import LLM, SamplingParams

    path = shape_checkpoint(args.shape)
    rates = None
    if args.floor:  # measured before the engine takes the device's memory
        from gpu_common import copy_bandwidth_bytes_per_s, matmul_flops_per_s

        rates = copy_bandwidth_bytes_per_s(), matmul_flops_per_s()
    llm = LLM(path, max_num_seqs=args.max_num_seqs, max_model_len=args.prompt_len + args.max_tokens,
              max_num_batched_tokens=args.max_num_batched_tokens)
    vocab = llm.engine_core.executor.worker.hf_config.vocab_size
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.prompt_len)]}
               for _ in range(args.num_prompts)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, n=2), use_tqdm=False)  # warm-up
    kv = llm.engine_core.scheduler.kv_cache_manager
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, n=args.n, ignore_eos=True)
    times = []
    floor = None
    for i in range(args.repeats):
        llm.reset_prefix_cache()  # every rollout computes its prompts once, as a new GRPO step's would
        if rates is not None and i == args.repeats - 1:
            from gpu_common import StepFloor

            floor = StepFloor(llm, *rates)  # the last timed rollout's steps
        hits0 = kv.total_prefix_cache_hits
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        times.append(time.perf_counter() - start)
    elapsed = sorted(times)[len(times) // 2]
    num_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    block_size = llm.config.cache.block_size
    shareable = args.num_prompts * (args.n - 1) * ((args.prompt_len - 1) // block_size) * block_size
    hits = kv.total_prefix_cache_hits - hits0
    stats = llm.engine_core.scheduler.make_stats()
    result = dict(benchmark="grpo_rollout", shape=args.shape, num_prompts=args.num_prompts, n=args.n,
                  prompt_len=args.prompt_len, max_tokens=args.max_tokens, temperature=args.temperature,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=llm.engine_core.scheduler.max_num_batched_tokens,
                  gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                  elapsed_s=elapsed, output_tokens=num_out, output_tok_per_s=num_out / elapsed,
                  prefix_hit_tokens=hits, shareable_prompt_tokens=shareable, hit_rate_of_shareable=hits / shareable,
                  num_preemptions=getattr(stats, "num_preemptions", None), num_kv_blocks=llm.engine_core.num_blocks,
                  elapsed_all_s=times)
    if floor is not None:
        result["floor"] = floor.summary(num_out, times[-1])
    print(f"\nGRPO rollout: {args.num_prompts} prompts x n={args.n}, prompt {args.prompt_len}, "
          f"max_tokens {args.max_tokens}, {args.shape}")
    print(f"{'output tokens':>14}{'time (s)':>10}{'tok/s':>10}{'hit tokens':>12}{'shareable':>11}{'hit rate':>10}")
    print(f"{num_out:>14}{elapsed:>10.3f}{num_out / elapsed:>10.0f}{hits:>12}{shareable:>11}{hits / shareable:>10.1%}")
    if floor is not None:
        f = result["floor"]
        print(f"floor: {1e3 * f['floor_s']:.1f} ms over {f['num_steps']} steps (bytes {1e3 * f['bytes_s']:.1f} ms, "
              f"FLOPs {1e3 * f['flops_s']:.1f} ms): the rollout at {f['fraction_of_floor']:.2f} of its floor")
    write_json(args.json_out, result)
    if args.busy:
        from gpu_common import device_busy

        llm.reset_prefix_cache()
        result["busy"] = b = device_busy(lambda: llm.generate(prompts, params, use_tqdm=False))
        # The profiler slows the host, not the device: the device's busy seconds over the unprofiled rollout's
        # wall time is the share of the timed rollout the device worked.
        b["busy_share_of_unprofiled"] = b["busy_s"] / elapsed
        print(f"under the profiler: wall {1e3 * b['wall_s']:.1f} ms, GPU busy {1e3 * b['busy_s']:.1f} ms "
              f"({b['busy_share']:.0%}; the host's share the rest); busy over the unprofiled rollout's "
              f"{1e3 * elapsed:.1f} ms: {b['busy_share_of_unprofiled']:.0%}")
    write_json(args.json_out, result)


if __name__ == "__main__":
    main()

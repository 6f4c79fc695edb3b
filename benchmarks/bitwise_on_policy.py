"""Bitwise on-policy (issue 28): identical requests with and without prefix-cache hits, trainer vs engine logprobs,
and what batch-invariant mode costs, for the default and the batch-invariant engine on a random-weight shape.

    python benchmarks/bitwise_on_policy.py --shape qwen3-0.6b            # H200: table on stdout, JSON under $OUT

1. Identical requests: --num-identical copies of one prompt (greedy, logprobs on) in one batch, prefix caching
   off; then the same batch twice with caching on (the second run hits the cache on every request). Each
   request is compared with the request run alone: tokens equal, logprobs equal, mean |delta logprob|.
2. Trainer vs engine: --num-prompts x --n seeded samples (GRPO-shaped groups: n - 1 of each hit the cache);
   the trainer's logprobs of them (trainers.policy.Policy under FSDP2, bf16: the HF forward in default mode,
   the engine-kernel forward trainers/invariant_forward.py in invariant mode); mean and max |delta|.
3. Throughput: the nano-vllm workload (benchmarks/workload.py) on each engine; invariant / default ratio.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import load, make_workload, resolve_model, vocab_size_of, write_json  # noqa: E402

MODES = ("default", "invariant")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b", help="random-weight model of a published shape (gpu_common.SHAPES)")
    p.add_argument("--model", default=None, help="a checkpoint directory or built-in tiny model instead of --shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-identical", type=int, default=64, help="part 1: copies of the one prompt")
    p.add_argument("--prompt-len", type=int, default=190)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64, help="part 2: prompts (times --n samples = rollouts)")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0, help="part 2's sampling temperature")
    p.add_argument("--trainer-batch", type=int, default=32, help="part 2: sequences per trainer forward")
    # Part 3: the nano-vllm workload, as benchmarks/offline_throughput.py has it.
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                   help="the engine's share (the trainer of part 2 needs the rest)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", nargs="*", default=[], choices=["identical", "trainer", "throughput"])
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/bitwise_on_policy.json, else benchmarks/out/)")
    return p.parse_args()


def make_llm(path: str, mode: str, args, **kw):
    from engine import LLM

    extra = dict(gpu_memory_utilization=args.gpu_memory_utilization) if args.device != "cpu" else {}
    extra.update(kw)
    return LLM(path, device=args.device, dtype="bfloat16", batch_invariant=mode == "invariant",
               logprobs_mode="processed_logprobs", max_model_len=max(args.prompt_len + args.max_tokens, 2048), **extra)


def free(llm) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def results(outputs) -> list[tuple[list[int], list[float]]]:
    out = []
    for o in outputs:
        c = o.outputs[0]
        out.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return out


def compare(got, want) -> dict:
    """How many of `got` equal the request run alone (`want`), tokens and logprobs, and their mean |delta logprob|."""
    same_tokens = sum(t == want[0] for t, _ in got)
    same_logprobs = sum(t == want[0] and lp == want[1] for t, lp in got)
    deltas = [abs(a - b) for t, lp in got for a, b in zip(lp, want[1])]
    return {"tokens_identical": same_tokens, "logprobs_identical": same_logprobs, "num": len(got),
            "mean_abs_delta_logprob": sum(deltas) / max(len(deltas), 1)}


def identical_requests(path: str, mode: str, args) -> dict:
    from engine import SamplingParams

    rng = random.Random(args.seed)
    prompt = {"prompt_token_ids": [rng.randrange(3, vocab_size_of(path)) for _ in range(args.prompt_len)]}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
    batch = [prompt] * args.num_identical
    rows = {}
    llm = make_llm(path, mode, args, enable_prefix_caching=False)
    (alone,) = results(llm.generate([prompt], params, use_tqdm=False))
    rows["no cache, batch"] = compare(results(llm.generate(batch, params, use_tqdm=False)), alone)
    free(llm)
    llm = make_llm(path, mode, args, enable_prefix_caching=True)
    first = llm.generate(batch, params, use_tqdm=False)
    rows["cache on, first batch"] = compare(results(first), alone)
    rows["cache on, first batch"]["num_cached"] = sum(o.num_cached_tokens > 0 for o in first)
    again = llm.generate(batch, params, use_tqdm=False)  # every request hits the cache now
    rows["cache on, again (hits)"] = compare(results(again), alone)
    rows["cache on, again (hits)"]["num_cached"] = sum(o.num_cached_tokens > 0 for o in again)
    free(llm)
    return rows


def trainer_vs_engine(path: str, mode: str, args) -> dict:
    from trainers.config import ModelConfig, OptimConfig
    from trainers.policy import Policy, init_distributed
    from trainers.rollouts import generate_rollouts

    rng = random.Random(args.seed + 1)
    vocab = vocab_size_of(path)
    lengths = [rng.randint(max(1, args.prompt_len // 3), args.prompt_len) for _ in range(args.num_prompts)]
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in lengths]
    llm = make_llm(path, mode, args)
    start = time.perf_counter()
    rollouts = generate_rollouts(llm, prompts, n=args.n, temperature=args.temperature, max_tokens=args.max_tokens,
                                 seed=args.seed)
    generate_s = time.perf_counter() - start
    free(llm)
    init_distributed(args.device)
    policy = Policy(ModelConfig(path=path, device=args.device, param_dtype="bfloat16",
                                invariant_forward=mode == "invariant"), OptimConfig())
    deltas, masks = [], []
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, rollouts.num_samples, args.trainer_batch):
            sl = slice(i, i + args.trainer_batch)
            got, _ = policy.response_logprobs(rollouts.input_ids[sl], rollouts.prompt_lens[sl],
                                              rollouts.response_ids[sl], temperature=args.temperature)
            deltas.append((got.float().cpu() - rollouts.rollout_logprobs[sl]).abs())
            masks.append(rollouts.response_mask[sl])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    score_s = time.perf_counter() - start
    del policy
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    delta, mask = torch.cat(deltas), torch.cat(masks).bool()
    d = delta[mask]
    return {"num_rollouts": rollouts.num_samples, "num_tokens": int(mask.sum()),
            "trainer_forward": "invariant_forward" if mode == "invariant" else "hf",
            "mean_abs_delta": float(d.mean()), "max_abs_delta": float(d.max()),
            "tokens_exact": float((d == 0).float().mean()), "generate_s": generate_s, "trainer_score_s": score_s}


def throughput(path: str, mode: str, args) -> dict:
    from engine import SamplingParams

    work = make_workload(args, vocab_size_of(path))
    llm = make_llm(path, mode, args, max_num_seqs=args.max_num_seqs)
    llm.generate([{"prompt_token_ids": p} for p, _ in work[:4]],
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()  # the warm-up's prompts must not give the timed run cache hits
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    free(llm)
    return {"elapsed_s": elapsed, "output_tokens": num_out, "output_tok_per_s": num_out / elapsed}


def main() -> None:
    args = parse_args()
    if args.model:
        path, name = resolve_model(args.model), args.model
    else:
        from gpu_common import shape_checkpoint

        path, name = shape_checkpoint(args.shape), args.shape
    result = {"benchmark": "bitwise_on_policy", "model": name, "args": vars(args), "load_before": load(),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    for mode in MODES:
        part = result.setdefault(mode, {})
        if "identical" not in args.skip:
            part["identical"] = identical_requests(path, mode, args)
        if "trainer" not in args.skip:
            part["trainer_vs_engine"] = trainer_vs_engine(path, mode, args)
        if "throughput" not in args.skip:
            part["throughput"] = throughput(path, mode, args)
    if "throughput" not in args.skip:
        result["invariant_over_default_throughput"] = (result["invariant"]["throughput"]["output_tok_per_s"]
                                                       / result["default"]["throughput"]["output_tok_per_s"])
    result["load_after"] = load()

    print(f"\n{name}, bf16, {args.num_identical} identical requests of {args.prompt_len} tokens, "
          f"{args.max_tokens} greedy tokens, against the request alone")
    print(f"{'mode':<10} {'run':<24} {'tokens ==':>10} {'logprobs ==':>12} {'cached':>7} {'mean |d lp|':>12}")
    for mode in MODES:
        for run, row in result[mode].get("identical", {}).items():
            print(f"{mode:<10} {run:<24} {row['tokens_identical']:>6}/{row['num']:<3} {row['logprobs_identical']:>8}/"
                  f"{row['num']:<3} {row.get('num_cached', 0):>7} {row['mean_abs_delta_logprob']:>12.3e}")
    if "trainer" not in args.skip:
        print(f"\ntrainer vs engine logprobs, {args.num_prompts} x {args.n} rollouts, T={args.temperature}")
        print(f"{'mode':<10} {'trainer forward':<18} {'mean |d|':>10} {'max |d|':>10} {'exact tokens':>13}")
        for mode in MODES:
            r = result[mode]["trainer_vs_engine"]
            print(f"{mode:<10} {r['trainer_forward']:<18} {r['mean_abs_delta']:>10.3e} {r['max_abs_delta']:>10.3e} "
                  f"{r['tokens_exact']:>12.1%}")
    if "throughput" not in args.skip:
        print(f"\nnano-vllm workload ({args.num_requests} requests, lengths U{args.input_len} / U{args.output_len})")
        for mode in MODES:
            r = result[mode]["throughput"]
            print(f"{mode:<10} {r['output_tok_per_s']:>10.1f} output tok/s in {r['elapsed_s']:.2f} s")
        print(f"invariant / default: {result['invariant_over_default_throughput']:.3f}")
    out = args.out or os.path.join(os.environ.get("OUT") or "benchmarks/out", "bitwise_on_policy.json")
    write_json(out, result)


if __name__ == "__main__":
    main()

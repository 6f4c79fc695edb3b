"""Train/inference logprob mismatch with the KV cache in the model's dtype and in fp8: ours against HF transformers.

Our engine samples (T=1, logprobs=0: each sampled token's logprob) on random prompts; HF
transformers, the trainer's side, scores the same sequences in one forward pass in the same
dtype. Per kv_cache_dtype it reports the token-level mismatch: mean and max |logp_ours -
logp_hf|, the k3 estimate of KL(ours || hf) (mean of exp(d) - 1 - d with d = logp_hf -
logp_ours), and the share of tokens off by more than 0.1. Table on stdout, JSON with the
machine's load. Throughput of the two settings comes from offline_throughput.py
--kv-cache-dtype, run beside this.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_throughput import load  # noqa: E402
from workload import resolve_model, vocab_size_of, write_json  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3", help="checkpoint directory or built-in tiny model name")
    p.add_argument("--shape", default=None, help="GPU: random-weight model of a published shape (gpu_common.SHAPES)")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8"])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="ours; HF's copy of the model shares the GPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default="benchmarks/out/fp8_kv_mismatch.json")
    return p.parse_args()


def sample(args, path: str, kv_cache_dtype: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]], str]:
    """Our engine's sampled tokens and their logprobs per prompt; the engine's dtype."""
    from engine import LLM, SamplingParams

    extra = dict(gpu_memory_utilization=args.gpu_memory_utilization) if torch.cuda.is_available() else {}
    llm = LLM(path, dtype=args.dtype, device=args.device, kv_cache_dtype=kv_cache_dtype, seed=args.seed,
              max_model_len=args.prompt_len[1] + args.max_tokens, **extra)
    params = [SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0, seed=args.seed + i)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(toks, o.outputs[0].logprobs, strict=True)]
                for toks, o in zip(tokens, outs, strict=True)]
    dtype = str(llm.engine_core.executor.worker.dtype) if hasattr(llm.engine_core.executor, "worker") else args.dtype
    llm.shutdown()
    return tokens, logprobs, dtype


def hf_logprobs(model, prompt: list[int], tokens: list[int], device: str) -> list[float]:
    """The trainer's logprob of each sampled token: one forward over prompt + output, log_softmax in float32."""
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]: the positions that predicted them
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0].tolist()


def mismatch(ours: list[list[float]], theirs: list[list[float]]) -> dict:
    a = torch.tensor([x for row in ours for x in row], dtype=torch.float64)
    b = torch.tensor([x for row in theirs for x in row], dtype=torch.float64)
    d = b - a
    return {"tokens": int(a.numel()), "mean_abs": float(d.abs().mean()), "max_abs": float(d.abs().max()),
            "k3_kl": float((d.exp() - 1 - d).mean()), "frac_over_0.1": float((d.abs() > 0.1).double().mean()),
            "mean_logprob": float(a.mean())}


def main() -> None:
    args = parse_args()
    if args.shape:
        from gpu_common import shape_checkpoint

        path, args.model = shape_checkpoint(args.shape), args.shape
    else:
        path = resolve_model(args.model)
    rng = random.Random(args.seed)
    vocab = vocab_size_of(path)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_len))] for _ in range(args.num_prompts)]
    runs = {}
    for kv in args.kv_cache_dtypes:
        start = time.perf_counter()
        tokens, logprobs, dtype = sample(args, path, kv, prompts)
        runs[kv] = dict(tokens=tokens, logprobs=logprobs, dtype=dtype, sample_s=time.perf_counter() - start)

    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    torch_dtype = {"torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}.get(runs[args.kv_cache_dtypes[0]]["dtype"],
                                                                                        torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device).eval()
    rows = {}
    for kv, run in runs.items():
        theirs = [hf_logprobs(model, p, t, device) for p, t in zip(prompts, run["tokens"], strict=True)]
        rows[kv] = mismatch(run["logprobs"], theirs)
    del model

    print(f"\nTrain/inference mismatch: {args.model}, {args.num_prompts} prompts {args.prompt_len}, "
          f"{args.max_tokens} sampled tokens each (T=1), ours vs HF transformers forward, {torch_dtype}")
    print(f"{'kv_cache_dtype':<15}{'tokens':>8}{'mean |d|':>11}{'max |d|':>10}{'k3 KL':>11}{'|d|>0.1':>9}")
    for kv, r in rows.items():
        print(f"{kv:<15}{r['tokens']:>8}{r['mean_abs']:>11.4f}{r['max_abs']:>10.3f}{r['k3_kl']:>11.2e}"
              f"{r['frac_over_0.1']:>9.3f}")
    write_json(args.json_out, {
        "benchmark": "fp8_kv_mismatch", "model": args.model, "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "dtype": str(torch_dtype),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__,
        "mismatch": rows, "sample_s": {kv: r["sample_s"] for kv, r in runs.items()},
        "load": load(),
    })
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

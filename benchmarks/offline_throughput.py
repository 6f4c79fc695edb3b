"""Offline throughput: our engine against HF transformers generate() on the same random workload.

Prints a table (output tokens/s for both and their ratio) and writes JSON. Prompt and output
lengths are drawn uniformly from ranges; every request runs to its max_tokens (ignore_eos).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import make_workload, resolve_model, vocab_size_of, write_json  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="checkpoint directory or built-in tiny model name")
    p.add_argument("--shape", default=None, help="GPU: random-weight model of a published shape "
                   "(qwen3-0.6b, qwen2.5-7b), built under /tmp; overrides --model")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--hf-num-requests", type=int, default=None,
                   help="run HF generate() on only the first N requests (it is slow on long outputs)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    # Defaults: the nano-vllm workload (256 requests, prompt and output lengths uniform in
    # [100, 1024]) and the engine's default max_num_seqs; on the tiny model a 2-core CPU runs
    # it in about two minutes, HF included. HF's cost grows with the padded length (every
    # step attends over, and re-copies, the batch's longest context), so shorter ranges
    # narrow the gap (benchmarks/results/NOTES-cpu.md has both).
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--hf-batch-size", type=int, default=None, help="HF static batch size (default: max-num-seqs)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json-out", default="benchmarks/out/offline_throughput.json")
    return p.parse_args()


def run_engine(args, path: str, work) -> dict:
    from engine import LLM, SamplingParams

    extra = {}
    if torch.cuda.is_available() and args.device != "cpu":
        extra = dict(gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager)
    llm = LLM(path, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.input_len[1] + args.output_len[1], **extra)
    warm = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 4
    llm.generate([{"prompt_token_ids": p} for p, _ in work[:4]], warm, use_tqdm=False)
    llm.reset_prefix_cache()  # the warm-up prompts must not give the timed run cache hits

    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True) for _, n in work]
    _sync(llm.config.device.resolve())
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    _sync(llm.config.device.resolve())
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_out == sum(n for _, n in work), "every request runs to max_tokens"
    worker = llm.engine_core.executor.worker
    graphs = worker.model_runner.cuda_graphs
    result = {"elapsed_s": elapsed, "output_tokens": num_out, "output_tok_per_s": num_out / elapsed,
              "device": llm.config.device.resolve(), "dtype": str(worker.dtype),
              "num_kv_blocks": llm.engine_core.num_blocks,
              "cuda_graph_replays": graphs.num_replays if graphs is not None else 0}
    llm.engine_core.shutdown()
    del llm, worker, graphs
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    return result


def run_hf(args, path: str, work, device: str, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos
    batch_size = args.hf_batch_size or args.max_num_seqs

    def generate(batch):
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(batch):  # left padding, as HF decoder-only generation wants
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        sample = dict(do_sample=True, temperature=args.temperature, top_k=0) if args.temperature else dict(do_sample=False)
        with torch.no_grad():
            model.generate(ids.to(device), attention_mask=mask.to(device), pad_token_id=0,
                           max_new_tokens=max(n for _, n in batch), **sample)

    work = work[: args.hf_num_requests or len(work)]
    generate(work[:2])  # warm-up
    _sync(device)
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        generate(work[i : i + batch_size])
    _sync(device)
    elapsed = time.perf_counter() - start
    # Only the tokens each request asked for count; padding to the batch's longest is HF's cost.
    num_out = sum(n for _, n in work)
    return {"elapsed_s": elapsed, "output_tokens": num_out, "output_tok_per_s": num_out / elapsed,
            "batch_size": batch_size, "num_requests": len(work)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    args = parse_args()
    if args.shape:
        from gpu_common import shape_checkpoint

        args.model = args.shape
        path = shape_checkpoint(args.shape)
    else:
        path = resolve_model(args.model)
    work = make_workload(args, vocab_size_of(path))
    ours = run_engine(args, path, work)
    result = {
        "benchmark": "offline_throughput",
        "model": args.model,
        "num_requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs,
        "temperature": args.temperature,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "machine": platform.node(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "engine": ours,
        "output_tok_per_s": ours["output_tok_per_s"],
    }
    rows = [("ours", ours)]
    if not args.skip_hf:
        dtype = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16,
                 "torch.float16": torch.float16}[ours["dtype"]]
        hf = run_hf(args, path, work, ours["device"], dtype)
        result["hf"] = hf
        result["ratio_vs_hf"] = ours["output_tok_per_s"] / hf["output_tok_per_s"]
        rows.append(("hf generate()", hf))

    print(f"\nOffline throughput: {args.num_requests} requests, prompt {args.input_len}, output {args.output_len}, "
          f"model {args.model}, device {ours['device']}, {ours['dtype']}")
    print(f"{'engine':<16}{'output tokens':>15}{'time (s)':>12}{'output tok/s':>15}")
    for name, r in rows:
        print(f"{name:<16}{r['output_tokens']:>15}{r['elapsed_s']:>12.2f}{r['output_tok_per_s']:>15.1f}")
    if "ratio_vs_hf" in result:
        print(f"ratio ours / HF: {result['ratio_vs_hf']:.2f}x")
    write_json(args.json_out, result)


if __name__ == "__main__":
    main()

"""Serving benchmark: C concurrent streaming clients against `rollout launch`, plus ZMQ vs in-process.

Part 1 starts a real `rollout launch` server on a free loopback port and drives it with C
concurrent streaming /v1/completions clients; it reports request and output-token
throughput, TTFT p50/p99 and inter-token latency p50/p99. Part 2 runs the same workload
straight through AsyncLLM twice - engine core in-process and in its own process over ZMQ -
and reports output tokens/s of each. Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import make_workload, resolve_model, vocab_size_of, write_json  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="checkpoint directory or built-in tiny model name")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32, help="C: concurrent streaming clients")
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default="benchmarks/out/serving.json")
    return p.parse_args()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- part 1: HTTP ------------------------------------------------------------------------------


async def _stream_one(client, prompt, max_tokens, results) -> None:
    import httpx  # noqa: F401 (client is an httpx.AsyncClient)

    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    token_times: list[float] = []
    num_tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                token_times.append(time.perf_counter())
    end = time.perf_counter()
    results.append({
        "ttft": token_times[0] - start if token_times else end - start,
        "itl": [b - a for a, b in zip(token_times, token_times[1:])],
        "e2e": end - start,
        "num_tokens": num_tokens,
    })


async def run_http(args, base_url: str, work) -> dict:
    import httpx

    results: list[dict] = []
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        async def worker(prompt, n):
            async with sem:
                await _stream_one(client, prompt, n, results)

        start = time.perf_counter()
        await asyncio.gather(*(worker(p, n) for p, n in work))
        elapsed = time.perf_counter() - start
    num_tokens = sum(r["num_tokens"] for r in results)
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results]
    return {
        "elapsed_s": elapsed,
        "requests_per_s": len(results) / elapsed,
        "output_tokens": num_tokens,
        "output_tok_per_s": num_tokens / elapsed,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "itl_p50_ms": percentile(itl, 50) * 1e3,
        "itl_p99_ms": percentile(itl, 99) * 1e3,
    }


def start_server(args, path: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rollout.cli", "launch", "--model", path, "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--device", args.device,
           "--max-model-len", str(args.input_len[1] + args.output_len[1]), "--disable-log-stats",
           "--served-model-name", "bench"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    for line in proc.stdout:
        if "serving" in line and "http://" in line:
            return proc
        if time.time() > deadline:
            break
    proc.kill()
    raise RuntimeError("rollout launch did not come up")


# ---- part 2: ZMQ vs in-process -----------------------------------------------------------------


async def run_async_llm(args, path: str, work, multiprocess: bool) -> dict:
    from engine.async_llm import AsyncLLM
    from engine.sampling_params import RequestOutputKind, SamplingParams

    llm = AsyncLLM.from_engine_args(model=path, multiprocess=multiprocess, max_num_seqs=args.max_num_seqs,
                                    device=args.device, max_model_len=args.input_len[1] + args.output_len[1],
                                    disable_log_stats=True)
    sem = asyncio.Semaphore(args.concurrency)
    counts: list[int] = []

    async def one(i, prompt, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        async with sem:
            num = 0
            async for out in llm.generate({"prompt_token_ids": prompt}, params, f"r{i}"):
                num += len(out.outputs[0].token_ids)
            counts.append(num)

    try:
        start = time.perf_counter()
        await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(work)))
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    return {"elapsed_s": elapsed, "output_tokens": sum(counts), "output_tok_per_s": sum(counts) / elapsed}


def main() -> None:
    args = parse_args()
    path = resolve_model(args.model)
    work = make_workload(args, vocab_size_of(path))

    port = free_port()
    server = start_server(args, path, port)
    try:
        http = asyncio.run(run_http(args, f"http://127.0.0.1:{port}", work))
    finally:
        server.terminate()
        server.wait(timeout=30)
    inproc = asyncio.run(run_async_llm(args, path, work, multiprocess=False))
    zmq = asyncio.run(run_async_llm(args, path, work, multiprocess=True))

    result = {"benchmark": "serving", "model": args.model, "num_requests": args.num_requests,
              "concurrency": args.concurrency, "input_len": args.input_len, "output_len": args.output_len,
              "http": http, "async_llm_inproc": inproc, "async_llm_zmq": zmq,
              "zmq_vs_inproc": zmq["output_tok_per_s"] / inproc["output_tok_per_s"]}
    print(f"\nServing: {args.num_requests} requests, {args.concurrency} concurrent streaming clients, "
          f"prompt {args.input_len}, output {args.output_len}, model {args.model}")
    print(f"{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}   (ms)")
    print(f"{http['requests_per_s']:>8.2f}{http['output_tok_per_s']:>11.1f}{http['ttft_p50_ms']:>10.1f}"
          f"{http['ttft_p99_ms']:>10.1f}{http['itl_p50_ms']:>9.2f}{http['itl_p99_ms']:>9.2f}")
    print(f"\n{'path':<26}{'output tok/s':>14}")
    print(f"{'AsyncLLM, in-process core':<26}{inproc['output_tok_per_s']:>14.1f}")
    print(f"{'AsyncLLM, core over ZMQ':<26}{zmq['output_tok_per_s']:>14.1f}")
    print(f"ZMQ / in-process: {result['zmq_vs_inproc']:.2f}x")
    write_json(args.json_out, result)


if __name__ == "__main__":
    main()

"""Server under load and hostile input: C concurrent clients against `rollout launch`, with and without an admission limit.

Part 1 starts `rollout launch --max-num-queued-reqs Q` and, after 8 warm-up requests, sends N
non-streaming /v1/completions requests from C concurrent clients (each sends its next request
when the last one answers; a refused client does not back off);
it reports the counts of 200 and 503 and the latency p50/p99 of each. A refusal must not wait
behind work: its floor is the round trip of a request the server answers without the engine
(GET /v1/models, timed under the same load), the target p99 under 100 ms.
Part 2 runs the same workload against a server without the limit: every answer a 200,
throughput and latency p50/p99.
Part 3 sends the requests that used to take the server down (n = 40000, 10**6 and 9542251074;
a 50 MB prompt) and reports each answer's status and time and the server's process-tree RSS
before and after.
The machine's load (`uptime`) is recorded with the results. Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import free_port, percentile  # noqa: E402
from workload import resolve_model, write_json  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum old songs".split()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="checkpoint directory or built-in tiny model name")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--max-num-queued-reqs", type=int, default=64, help="Q: the admission limit of part 1")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--prompt-words", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default="benchmarks/out/server_load.json")
    return p.parse_args()


def start_server(args, path: str, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "rollout.cli", "launch", "--model", path, "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--device", args.device, "--max-model-len", "512",
           "--disable-log-stats", "--disable-access-log", "--served-model-name", "bench", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + 180
    for line in proc.stdout:
        if "serving" in line and "http://" in line:
            return proc, f"http://127.0.0.1:{port}"
        if time.time() > deadline:
            break
    proc.kill()
    raise RuntimeError("rollout launch did not come up")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def tree_rss(pid: int) -> int:
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def make_bodies(args) -> list[dict]:
    rng = random.Random(args.seed)
    return [
        {"model": "bench", "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(*args.prompt_words))),
         "max_tokens": rng.randint(*args.output_len), "ignore_eos": True, "temperature": 0.0}
        for _ in range(args.num_requests)
    ]


class Connection:
    """One keep-alive HTTP/1.1 connection spoken by hand: a load generator must cost far less than
    the server it measures (httpx's async client takes ~5 ms of CPU a request, which on two cores
    made the client, not the server, the bottleneck)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split()[1])
        length, close = 0, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "connection" and value.strip().lower() == "close":
                close = True
        payload = await self.reader.readexactly(length)
        if close:
            self.close()
        return status, payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


async def run_load(args, url: str, bodies: list[dict]) -> dict:
    """C closed-loop clients over the bodies; latencies by status, and /v1/models probes under the load."""
    host, port = url.removeprefix("http://").split(":")
    payloads = [json.dumps(body).encode() for body in bodies]
    by_status: dict[int, list[float]] = {}
    probes: list[float] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        conn = Connection(host, int(port))
        try:
            while next_index < len(payloads):
                payload = payloads[next_index]
                next_index += 1
                start = time.perf_counter()
                status, _ = await conn.request("POST", "/v1/completions", payload)
                by_status.setdefault(status, []).append(time.perf_counter() - start)
        finally:
            conn.close()

    async def prober(done: asyncio.Event) -> None:
        conn = Connection(host, int(port))
        while not done.is_set():
            start = time.perf_counter()
            await conn.request("GET", "/v1/models")
            probes.append(time.perf_counter() - start)
            await asyncio.sleep(0.05)
        conn.close()

    # Warm-up, not counted: the server's first requests pay one-time costs (thread pools, first calls).
    warm = Connection(host, int(port))
    for payload in payloads[:8]:
        await warm.request("POST", "/v1/completions", payload)
    warm.close()

    done = asyncio.Event()
    probe_task = asyncio.create_task(prober(done))
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - start
    done.set()
    await probe_task
    result = {"elapsed_s": elapsed, "statuses": {str(s): len(v) for s, v in sorted(by_status.items())}}
    for status, latencies in sorted(by_status.items()):
        result[f"p50_ms_{status}"] = percentile(latencies, 50) * 1e3
        result[f"p99_ms_{status}"] = percentile(latencies, 99) * 1e3
        result[f"max_ms_{status}"] = max(latencies) * 1e3
    result["requests_per_s_200"] = len(by_status.get(200, [])) / elapsed
    result["probe_p50_ms"] = percentile(probes, 50) * 1e3
    result["probe_p99_ms"] = percentile(probes, 99) * 1e3
    result["client_cpu_s"] = time.process_time()
    return result


def hostile_cases(url: str, pid: int) -> dict:
    """The requests that grew the server without bound or froze it: status, seconds, RSS before/after."""
    import httpx

    cases = [
        ("n=40000", {"json": {"prompt": "hi", "max_tokens": 1, "n": 40000}}, "/v1/completions"),
        ("n=10**6", {"json": {"prompt": "hi", "max_tokens": 1, "n": 10**6}}, "/v1/completions"),
        ("chat n=9542251074", {"json": {"messages": [{"role": "user", "content": "hi"}], "n": 9542251074}},
         "/v1/chat/completions"),
        ("50 MB prompt", {"content": b'{"prompt": "' + b"a" * 50_000_000 + b'"}',
                          "headers": {"Content-Type": "application/json"}}, "/v1/completions"),
        ("20 MB prompt", {"json": {"prompt": "a b " * 5_000_000}}, "/v1/completions"),
    ]
    with httpx.Client(base_url=url, timeout=600) as client:
        client.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 4})
        rss_before = tree_rss(pid)
        rows = []
        for name, kwargs, path in cases:
            start = time.perf_counter()
            r = client.post(path, **kwargs)
            rows.append({"case": name, "status": r.status_code, "seconds": time.perf_counter() - start})
        healthy = client.get("/health").status_code == 200
    return {"cases": rows, "rss_before_mb": rss_before / 2**20, "rss_after_mb": tree_rss(pid) / 2**20,
            "healthy_after": healthy}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def print_load(title: str, r: dict) -> None:
    print(f"\n{title}: {r['elapsed_s']:.1f} s, answers {r['statuses']}, "
          f"/v1/models under load p50 {r['probe_p50_ms']:.1f} ms, p99 {r['probe_p99_ms']:.1f} ms")
    print(f"{'status':>8}{'count':>8}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for status, count in r["statuses"].items():
        print(f"{status:>8}{count:>8}{r[f'p50_ms_{status}']:>10.1f}{r[f'p99_ms_{status}']:>10.1f}"
              f"{r[f'max_ms_{status}']:>10.1f}")
    print(f"200s per second: {r['requests_per_s_200']:.1f}")


def main() -> None:
    args = parse_args()
    path = resolve_model(args.model)
    bodies = make_bodies(args)
    load_before = uptime()

    proc, url = start_server(args, path, "--max-num-queued-reqs", str(args.max_num_queued_reqs))
    try:
        limited = asyncio.run(run_load(args, url, bodies))
    finally:
        stop_server(proc)
    proc, url = start_server(args, path)
    try:
        unlimited = asyncio.run(run_load(args, url, bodies))
        hostile = hostile_cases(url, proc.pid)
    finally:
        stop_server(proc)

    result = {"benchmark": "server_load", "model": args.model, "num_requests": args.num_requests,
              "concurrency": args.concurrency, "max_num_queued_reqs": args.max_num_queued_reqs,
              "max_num_seqs": args.max_num_seqs, "prompt_words": args.prompt_words, "output_len": args.output_len,
              "uptime_before": load_before, "uptime_after": uptime(), "cpu_count": os.cpu_count(),
              "with_admission_limit": limited, "without_admission_limit": unlimited, "hostile": hostile,
              "refusal_p99_target_ms": 100.0}
    print(f"\nServer load: {args.num_requests} requests from {args.concurrency} concurrent clients, model {args.model}, "
          f"max_num_seqs {args.max_num_seqs}; load before: {load_before}")
    print_load(f"With --max-num-queued-reqs {args.max_num_queued_reqs}", limited)
    print_load("Without an admission limit", unlimited)
    print(f"\nHostile cases (process tree RSS {hostile['rss_before_mb']:.0f} MB before, "
          f"{hostile['rss_after_mb']:.0f} MB after; healthy after: {hostile['healthy_after']})")
    print(f"{'case':<22}{'status':>8}{'seconds':>10}")
    for row in hostile["cases"]:
        print(f"{row['case']:<22}{row['status']:>8}{row['seconds']:>10.3f}")
    write_json(args.json_out, result)


if __name__ == "__main__":
    main()

"""Times cuBLAS and every candidate config of the small-M linear kernel on the model shapes, per call inside CUDA graphs.

Each measurement captures CALLS_PER_GRAPH back-to-back calls in one CUDA graph and replays it,
so launch overhead is gone (decode runs under graphs). The calls cycle through enough weight
copies to overflow L2 (decode streams every weight from HBM once per step). Prints a table and
the CONFIG_TABLE lines for engine/kernels/gemv.py; writes every timing as JSON.

    python benchmarks/gemv_configs.py --json-out benchmarks/out/h200-gemv-configs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.kernels import cdiv
from engine.kernels.gemv import M_BUCKETS, TARGET_PROGRAMS, GemvConfig, default_config, linear_triton, split_k_range

# (model, layer) -> (N, K), in the order they are measured (most important first).
SHAPES: dict[tuple[str, str], tuple[int, int]] = {
    ("qwen3-0.6b", "qkv"): (4096, 1024), ("qwen3-0.6b", "o"): (1024, 2048),
    ("qwen3-0.6b", "gate_up"): (6144, 1024), ("qwen3-0.6b", "down"): (1024, 3072),
    ("qwen3-0.6b", "lm_head"): (151936, 1024),
    ("qwen2.5-1.5b", "qkv"): (2048, 1536), ("qwen2.5-1.5b", "o"): (1536, 1536),
    ("qwen2.5-1.5b", "gate_up"): (17920, 1536), ("qwen2.5-1.5b", "down"): (1536, 8960),
    ("qwen2.5-7b", "qkv"): (4608, 3584), ("qwen2.5-7b", "o"): (3584, 3584),
    ("qwen2.5-7b", "gate_up"): (37888, 3584), ("qwen2.5-7b", "down"): (3584, 18944),
    ("qwen2.5-7b", "lm_head"): (152064, 3584),
}
CALLS_PER_GRAPH = 50
REPLAYS = 5
ROTATE_BYTES = 256 << 20  # weight copies per shape add up to at least this (H200 L2 is 50 MiB)

# Candidate grids, (BLOCK_N, BLOCK_K, num_warps); edit freely. fma (M == 1 only) keeps its
# [BLOCK_N, BLOCK_K] float32 accumulator in registers: at most FMA_MAX_ACC per thread.
FMA_TILES = [(4, 512, 4), (4, 1024, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 4), (16, 256, 4), (16, 512, 4),
             (32, 256, 4), (32, 512, 8), (64, 256, 8)]
FMA_MAX_ACC = 128
DOT_TILES = [(16, 256, 4), (32, 128, 4), (32, 256, 4), (64, 128, 4), (64, 256, 8), (128, 128, 8)]
SPLITS = [1, 2, 4, 8, 16]
MAX_PROGRAMS = 16 * 132  # splitting beyond this many programs only adds partial-sum traffic
STAGES = [3]
REFINE_STAGES = [2, 4]  # tried on each case's winner only (each value is a separate compile)


def candidates(m: int, n: int, k: int) -> list[GemvConfig]:
    """Every config to time for one (M, N, K), the heuristic's default first."""
    out = [default_config(m, n, k)]
    tiles = [(bn, bk, w, False) for bn, bk, w in FMA_TILES if m == 1 and bn * bk // (32 * w) <= FMA_MAX_ACC]
    tiles += [(bn, bk, w, True) for bn, bk, w in DOT_TILES]
    for bn, bk, warps, use_dot in tiles:
        num_n_blocks = cdiv(n, bn)
        for asked in SPLITS:
            split = split_k_range(k, bk, asked)[1]  # what the launch would use
            if split > 1 and (num_n_blocks * split > MAX_PROGRAMS or num_n_blocks >= 2 * TARGET_PROGRAMS):
                continue  # past the useful grid size, or already plenty of programs
            for stages in STAGES:
                out.append(GemvConfig(bn, bk, split, use_dot, warps, stages))
    return list(dict.fromkeys(out))  # de-duplicated, order kept


def graph_us_per_call(fn: Callable[[int], torch.Tensor]) -> float:
    """Per-call microseconds of fn(0..CALLS_PER_GRAPH-1) captured back to back in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile / pick algorithms outside the capture
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS_PER_GRAPH)


def eager_us_per_call(fn: Callable[[int], torch.Tensor]) -> float:
    """Per-call microseconds of CALLS_PER_GRAPH eager calls (launch overhead included)."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(CALLS_PER_GRAPH):
        fn(i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH


def _calls(x: torch.Tensor, weights: list[torch.Tensor], cfg: GemvConfig | None) -> Callable[[int], torch.Tensor]:
    """Call i of a timed run: x times weight copy i (cycling), through cuBLAS (cfg None) or the kernel with cfg."""
    if cfg is None:
        return lambda i: F.linear(x, weights[i % len(weights)])
    return lambda i: linear_triton(x, weights[i % len(weights)], None, cfg)


def _time_configs(x: torch.Tensor, weights: list[torch.Tensor], configs: list[GemvConfig], deadline: float,
                  timings: list[tuple[GemvConfig, float]]) -> None:
    """Appends (config, us per call) for each config, until the deadline (the first one always runs)."""
    for j, cfg in enumerate(configs):
        if j > 0 and time.perf_counter() > deadline:
            print(f"  time budget spent: {len(configs) - j} configs of M={x.shape[0]} {tuple(weights[0].shape)} not timed")
            return
        try:
            timings.append((cfg, graph_us_per_call(_calls(x, weights, cfg))))
        except Exception as e:  # noqa: BLE001  (a config that does not compile or fit is skipped)
            print(f"  M={x.shape[0]} {tuple(weights[0].shape)} {cfg}: {type(e).__name__}: {str(e)[:120]}")


def bench_shape(n: int, k: int, ms: list[int], deadline: float) -> list[dict]:
    """All M rows of one (N, K): cuBLAS, the default config, every candidate (until the deadline)."""
    num_copies = max(1, math.ceil(ROTATE_BYTES / (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(num_copies)]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cands = candidates(m, n, k)
        timings: list[tuple[GemvConfig, float]] = []
        _time_configs(x, weights, cands, deadline, timings)
        best_cfg = min(timings, key=lambda t: t[1])[0]
        if time.perf_counter() < deadline:
            refine = [dataclasses.replace(best_cfg, num_stages=s) for s in REFINE_STAGES]
            _time_configs(x, weights, [c for c in refine if c not in cands], deadline, timings)
        best_cfg, best_us = min(timings, key=lambda t: t[1])
        rows.append({
            "N": n, "K": k, "M": m, "bytes": (n * k + m * k + m * n) * 2,
            "cublas_us": graph_us_per_call(_calls(x, weights, None)),
            "default_config": dataclasses.asdict(cands[0]),
            "default_us": next((us for c, us in timings if c == cands[0]), float("nan")),
            "best_config": dataclasses.asdict(best_cfg), "best_us": best_us,
            "cublas_eager_us": eager_us_per_call(_calls(x, weights, None)),
            "best_eager_us": eager_us_per_call(_calls(x, weights, best_cfg)),
            "candidates": [{"config": dataclasses.asdict(c), "us": us} for c, us in timings],
        })
    return rows


def config_literal(cfg: dict) -> str:
    return (f"GemvConfig({cfg['block_n']}, {cfg['block_k']}, split_k={cfg['split_k']}, use_dot={cfg['use_dot']}, "
            f"num_warps={cfg['num_warps']}, num_stages={cfg['num_stages']})")


def print_table(rows: list[dict], names: dict[tuple[int, int], str]) -> None:
    def gbps(r: dict, us: float) -> float:
        return r["bytes"] / us / 1e3

    print(f"{'shape':<22}{'N':>7}{'K':>6}{'M':>4}{'cuBLAS us':>10}{'GB/s':>6}{'default us':>11}"
          f"{'best us':>9}{'GB/s':>6}{'speedup':>8}{'eager cuBLAS/best us':>22}  best config")
    for r in rows:
        c = r["best_config"]
        cfg = f"{'dot' if c['use_dot'] else 'fma'} {c['block_n']}x{c['block_k']} split {c['split_k']} " \
              f"w{c['num_warps']} s{c['num_stages']}"
        print(f"{names[(r['N'], r['K'])]:<22}{r['N']:>7}{r['K']:>6}{r['M']:>4}{r['cublas_us']:>10.2f}"
              f"{gbps(r, r['cublas_us']):>6.0f}{r['default_us']:>11.2f}{r['best_us']:>9.2f}{gbps(r, r['best_us']):>6.0f}"
              f"{r['cublas_us'] / r['best_us']:>8.2f}{r['cublas_eager_us']:>11.1f}/{r['best_eager_us']:<10.1f}  {cfg}")
    print("\n# CONFIG_TABLE entries for engine/kernels/gemv.py ((M bucket, N, K): config), where best beats default by >3%:")
    for r in rows:
        if not r["best_us"] >= 0.97 * r["default_us"]:  # a failed default (nan) lists the best too
            print(f"    ({r['M']}, {r['N']}, {r['K']}): {config_literal(r['best_config'])},")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json-out", default="benchmarks/out/gemv_configs.json")
    parser.add_argument("--ms", type=int, nargs="+", default=list(M_BUCKETS),
                        help="row counts M (the CONFIG_TABLE buckets, engine.kernels.gemv.M_BUCKETS)")
    parser.add_argument("--models", nargs="+", default=sorted({m for m, _ in SHAPES}), help="models whose shapes to time")
    parser.add_argument("--budget-s", type=float, default=105.0,
                        help="after this many seconds only cuBLAS and the default config are timed")
    args = parser.parse_args()
    start = time.perf_counter()
    deadline = start + args.budget_s
    names = {nk: f"{model} {layer}" for (model, layer), nk in SHAPES.items() if model in args.models}
    rows = []
    for (n, k), name in names.items():
        t = time.perf_counter()
        rows.extend(bench_shape(n, k, args.ms, deadline))
        torch.cuda.empty_cache()  # the shape's weight copies are gone
        print(f"{name} ({n}x{k}) done in {time.perf_counter() - t:.1f} s", flush=True)
    print_table(rows, names)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    with open(args.json_out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "calls_per_graph": CALLS_PER_GRAPH, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

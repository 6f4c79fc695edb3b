"""Times the Triton decode attention tile configs (and split-KV) on the GPU: KV bytes read / time per config.

Two kinds of batch: every row at one context length (--uniform-ctx), and rows whose contexts
are uniform in --mixed-ctx, as in the offline benchmark's decode phase, where a long row's
program can finish alone. Splits: the engine's heuristic (1 for large batches), or a fixed
count for every batch. Order: programs in row order, or longest context first
(engine.kernels.attention.LONGEST_FIRST). Prints one table and writes JSON; the chosen tile
config is engine.kernels.attention.DECODE_CONFIG.

    python benchmarks/attention_configs.py --json-out benchmarks/out/attention_configs.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random

import torch
import triton

from engine.attention.metadata import AttentionMetadata
from engine.kernels import attention

# (BLOCK_N, num_warps, num_stages)
TILES = [(32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 2, 3), (128, 4, 2), (128, 8, 2), (128, 4, 3)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128, 192, 256])
    p.add_argument("--uniform-ctx", type=int, default=1024)
    p.add_argument("--mixed-ctx", type=int, nargs=2, default=[100, 2048], metavar=("MIN", "MAX"))
    p.add_argument("--splits", type=int, nargs="+", default=[0, 2],
                   help="0: the engine's heuristic; n: n splits for every batch")
    p.add_argument("--json-out", default="benchmarks/out/attention_configs.json")
    return p.parse_args()


def num_splits_fixed(n: int):
    def choose(max_query_len: int, num_programs: int) -> int:
        return 1 if max_query_len > 1 else n
    return choose


def main() -> None:
    args = parse_args()
    num_heads, num_kv_heads, head_size, block_size = 16, 8, 128, 16  # Qwen3-0.6B
    heuristic, default, default_order = attention._num_splits, dict(attention.DECODE_CONFIG), attention.LONGEST_FIRST
    rng = random.Random(0)
    rows = []
    for batch, kind in itertools.product(args.batches, ["uniform", "mixed"]):
        ctxs = [args.uniform_ctx] * batch if kind == "uniform" else [rng.randint(*args.mixed_ctx) for _ in range(batch)]
        nbs = [-(-c // block_size) for c in ctxs]
        perm = torch.randperm(sum(nbs) + 8).tolist()  # blocks scattered over the cache, as in a long run
        starts = [sum(nbs[:i]) for i in range(batch)]
        tables = [perm[s : s + nb] for s, nb in zip(starts, nbs)]
        md = AttentionMetadata.build([1] * batch, ctxs, tables, block_size, device="cuda")
        kv = torch.randn(2, sum(nbs) + 8, block_size, num_kv_heads, head_size, dtype=torch.bfloat16, device="cuda")
        q = torch.randn(batch, num_heads, head_size, dtype=torch.bfloat16, device="cuda")
        kv_bytes = 2 * sum(ctxs) * num_kv_heads * head_size * 2
        for (bn, warps, stages), splits, longest in itertools.product(TILES, args.splits, [False, True]):
            attention.DECODE_CONFIG = dict(BLOCK_N=bn, num_warps=warps, num_stages=stages)
            attention.LONGEST_FIRST = longest
            attention._num_splits = heuristic if splits == 0 else num_splits_fixed(splits)
            try:
                ms = triton.testing.do_bench(lambda: attention.paged_attention(q, kv, md, 0.088), warmup=25, rep=100,
                                             return_mode="median")
            except Exception as e:  # a config that does not fit (shared memory) is skipped
                print(f"batch {batch} {kind} BLOCK_N {bn} warps {warps} stages {stages}: {type(e).__name__}")
                continue
            rows.append(dict(batch=batch, ctx=kind, mean_ctx=sum(ctxs) / batch, BLOCK_N=bn, num_warps=warps,
                             num_stages=stages, splits="heuristic" if splits == 0 else splits,
                             order="longest" if longest else "rows", us=ms * 1e3,
                             GBps=kv_bytes / ms / 1e6))
    attention._num_splits, attention.DECODE_CONFIG, attention.LONGEST_FIRST = heuristic, default, default_order
    print(f"{'batch':>6}{'ctx':>8}{'BLOCK_N':>8}{'warps':>6}{'stages':>7}{'splits':>10}{'order':>8}{'us':>9}{'GB/s':>8}")
    for r in rows:
        print(f"{r['batch']:>6}{r['ctx']:>8}{r['BLOCK_N']:>8}{r['num_warps']:>6}{r['num_stages']:>7}{r['splits']:>10}"
              f"{r['order']:>8}{r['us']:>9.1f}{r['GBps']:>8.0f}")
    best = {}
    for r in rows:
        key = (r["batch"], r["ctx"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    print("\nfastest per batch:", "; ".join(f"{b} {c}: BLOCK_N {r['BLOCK_N']} w{r['num_warps']} s{r['num_stages']} "
                                           f"splits {r['splits']} {r['order']} {r['GBps']:.0f} GB/s" for (b, c), r in best.items()))
    os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump({"benchmark": "attention_configs", "gpu": torch.cuda.get_device_name(),
                   "default": {**default, "LONGEST_FIRST": default_order}, "rows": rows}, f, indent=1)
    print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()

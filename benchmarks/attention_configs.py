"""Times the Triton decode attention tile configs (and split-KV) on the H200: KV bytes read / time per config.

Prints one table; the chosen config is engine.kernels.attention.DECODE_CONFIG.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch
import triton

from engine.attention.metadata import AttentionMetadata
from engine.kernels import attention


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/out/attention_configs.json"
    num_heads, num_kv_heads, head_size, block_size = 16, 8, 128, 16
    rows = []
    for batch, ctx in [(1, 1024), (16, 1024), (64, 1024), (256, 1024)]:
        nb = -(-ctx // block_size)
        perm = torch.randperm(batch * nb + 8).tolist()
        tables = [perm[i * nb : (i + 1) * nb] for i in range(batch)]
        md = AttentionMetadata.build([1] * batch, [ctx] * batch, tables, block_size, device="cuda")
        kv = torch.randn(2, batch * nb + 8, block_size, num_kv_heads, head_size, dtype=torch.bfloat16, device="cuda")
        q = torch.randn(batch, num_heads, head_size, dtype=torch.bfloat16, device="cuda")
        kv_bytes = 2 * batch * ctx * num_kv_heads * head_size * 2
        for (bn, warps, stages), max_splits in itertools.product(
            [(32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 8, 2), (128, 4, 3)], [1, 16]
        ):
            attention.DECODE_CONFIG = dict(BLOCK_N=bn, num_warps=warps, num_stages=stages)
            attention._MAX_SPLITS = max_splits
            try:
                ms = triton.testing.do_bench(lambda: attention.paged_attention(q, kv, md, 0.088), warmup=25, rep=100,
                                             return_mode="median")
            except Exception as e:  # a config that does not fit (shared memory) is skipped
                print(f"batch {batch} BLOCK_N {bn} warps {warps} stages {stages}: {type(e).__name__}")
                continue
            rows.append(dict(batch=batch, ctx=ctx, BLOCK_N=bn, num_warps=warps, num_stages=stages,
                             max_splits=max_splits, us=ms * 1e3, GBps=kv_bytes / ms / 1e6))
    print(f"{'batch':>6}{'BLOCK_N':>8}{'warps':>6}{'stages':>7}{'splits':>7}{'us':>9}{'GB/s':>8}")
    for r in rows:
        print(f"{r['batch']:>6}{r['BLOCK_N']:>8}{r['num_warps']:>6}{r['num_stages']:>7}{r['max_splits']:>7}"
              f"{r['us']:>9.1f}{r['GBps']:>8.0f}")
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

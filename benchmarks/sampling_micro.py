"""Sampling micro-benchmark: one decode step's path from hidden states to sampled ids (LM head, Sampler, Gumbel-max kernel).

Per row count (default 1, 16, 64, 256) at vocab 151936 (Qwen3), logits in the model dtype
(bf16 on GPU), temperature 0.6, unseeded rows drawing keys from a device generator as the
model runner does; with and without top-k / top-p. Columns (ms per step):
  head      the LM head matmul alone (hidden [B, 1024] x weight [V, 1024])
  sampler   engine.sample.Sampler on the head's logits
  path      head + sampler: the whole per-step sampling path
  unfused   plain rows only: the path as it was before the one-pass kernel (float32 logits
            from the head, the sampler's float32 copy, an in-place temperature division, then
            the kernel), for comparison
  kernel    the Gumbel-max kernel alone on the bf16 logits with the temperature folded in
  row_scan  the same kernel with one chunk per row (one program scans a whole row)
  floor     one read of the bf16 logits at 4.3 TB/s (the measured device copy rate)
Times are per call, averaged over a loop of calls, minimum over repeats (shared machines
drift). Prints a table and writes JSON.

  python benchmarks/sampling_micro.py --device cuda --out benchmarks/out/sampling_micro_h200.json
  python benchmarks/sampling_micro.py --device cpu --rows 1,16 --out benchmarks/out/sampling_micro_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from engine.kernels import cdiv, use_triton
from engine.kernels.sampling import _BLOCK, gumbel_sample, gumbel_sample_triton
from engine.sample import Sampler, SamplingMetadata
from engine.sample.random_sampling import sampling_keys
from engine.sample.topk_topp import apply_temperature

VOCAB = 151936
HIDDEN = 1024
TEMPERATURE = 0.6
COPY_BYTES_PER_S = 4.3e12
FEATURES = {  # name -> (top_k, top_p)
    "plain": (None, None),
    "top_k=50,top_p=0.9": (50, 0.9),
    "top_p=0.9": (None, 0.9),
}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int, calls: int) -> float:
    """ms per call: the mean over `calls` back-to-back calls, minimum over `repeats` loops, after a warm-up."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def metadata(batch: int, top_k: int | None, top_p: float | None, device: str) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((batch,), TEMPERATURE, device=device),
        all_greedy=False,
        all_random=True,
        top_k=None if top_k is None else torch.full((batch,), top_k, dtype=torch.int64, device=device),
        top_p=None if top_p is None else torch.full((batch,), top_p, device=device),
        min_p=None,
        generators={},
        presence_penalties=None,
        frequency_penalties=None,
        repetition_penalties=None,
        prompt_token_ids=None,
        output_token_ids=[],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=None, help="calls per timed loop (default 20 on cuda, 2 on cpu)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = args.device
    calls = args.calls or (20 if device == "cuda" else 2)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out_path = args.out or f"benchmarks/out/sampling_micro_{device}.json"

    gen = torch.Generator(device="cpu").manual_seed(0)
    # Weights and hidden states scaled so the logits spread like an LM's (std ~ 4 nats).
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * (4.0 / HIDDEN**0.5)).to(device=device, dtype=dtype)
    max_rows = max(int(b) for b in args.rows.split(","))
    hidden_all = torch.randn(max_rows, HIDDEN, generator=gen).to(device=device, dtype=dtype)
    key_gen = torch.Generator(device=device).manual_seed(0)  # what the model runner hands the Sampler
    sampler = Sampler(key_gen)
    num_tiles = cdiv(VOCAB, _BLOCK)

    rows = []
    for batch in [int(b) for b in args.rows.split(",")]:
        hidden = hidden_all[:batch]
        logits = F.linear(hidden, weight)  # [B, V] model dtype, as LMHead returns it
        floor_ms = batch * VOCAB * logits.element_size() / COPY_BYTES_PER_S * 1e3
        head_ms = timed(lambda h=hidden: F.linear(h, weight), device, args.repeats, calls)
        temperature = torch.full((batch,), TEMPERATURE, device=device)
        keys = sampling_keys(batch, {}, key_gen, torch.device(device))
        kernel_ms = timed(lambda x=logits, k=keys, t=temperature: gumbel_sample(x, k, t), device, args.repeats, calls)
        row_scan_ms = None
        if use_triton(logits):
            row_scan_ms = timed(
                lambda x=logits, k=keys, t=temperature: gumbel_sample_triton(x, k, t, tiles_per_chunk=num_tiles),
                device,
                args.repeats,
                calls,
            )
        for name, (top_k, top_p) in FEATURES.items():
            md = metadata(batch, top_k, top_p, device)
            row = {"device": device, "dtype": str(dtype).removeprefix("torch."), "rows": batch, "vocab": VOCAB}
            row["features"] = name
            row["head_ms"] = head_ms
            row["sampler_ms"] = timed(lambda x=logits, md=md: sampler(x, md), device, args.repeats, calls)
            row["path_ms"] = timed(
                lambda h=hidden, md=md: sampler(F.linear(h, weight), md), device, args.repeats, calls
            )
            row["unfused_ms"] = None
            if name == "plain":

                def unfused(h=hidden, md=md):
                    x = F.linear(h, weight).float()  # the head's old float32 output
                    x = x.to(torch.float32, copy=True)  # the sampler's own copy
                    apply_temperature(x, md.temperature)
                    return gumbel_sample(x, sampling_keys(x.shape[0], {}, key_gen, x.device))

                row["unfused_ms"] = timed(unfused, device, args.repeats, calls)
            row["kernel_ms"] = kernel_ms
            row["row_scan_ms"] = row_scan_ms
            row["floor_ms"] = floor_ms
            rows.append(row)
            print(json.dumps(row), flush=True)

    def fmt(x):
        return f"{x:9.3f}" if x is not None else f"{'-':>9}"

    columns = ("head_ms", "sampler_ms", "path_ms", "unfused_ms", "kernel_ms", "row_scan_ms", "floor_ms")
    print(f"\n{'rows':>5} {'features':>20} " + " ".join(f"{c.removesuffix('_ms'):>9}" for c in columns) + "   (ms)")
    for r in rows:
        print(f"{r['rows']:>5} {r['features']:>20} " + " ".join(fmt(r[c]) for c in columns))
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()

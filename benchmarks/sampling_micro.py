"""Sampling micro-benchmark: sort-based vs partial-selection top-k/top-p, and the whole Sampler before/after.

"before" is the previous pipeline (full sort for top-k/top-p, softmax, exponential race with
one torch generator per seeded row); "after" is engine.sample as it is now (topk-based
top-k/top-p, one-pass Gumbel-max with counter-based noise). Half the rows are seeded.
Prints a table and writes JSON. Times are the minimum over repeats (shared machines drift).

  python benchmarks/sampling_micro.py --device cpu  --out benchmarks/out/sampling_micro_cpu.json
  python benchmarks/sampling_micro.py --device cuda --out benchmarks/out/sampling_micro_h200.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.sample import Sampler, SamplingMetadata, make_generator
from engine.sample.topk_topp import apply_min_p, apply_temperature, apply_top_k_top_p, apply_top_k_top_p_sort

VOCAB = 151936
FEATURES = {  # name -> (top_k, top_p)
    "plain": (None, None),
    "top_k=50": (50, None),
    "top_p=0.9": (None, 0.9),
    "top_k=50,top_p=0.9": (50, 0.9),
}


def make_logits(batch: int, kind: str, device: str) -> torch.Tensor:
    """flat: N(0, 2^2) logits (top-p 0.9 keeps thousands of tokens); peaked: 20 tokens 15 nats above the rest."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(batch, VOCAB, generator=gen) * 2.0
    if kind == "peaked":
        hot = torch.randint(0, VOCAB, (batch, 20), generator=gen)
        logits.scatter_add_(1, hot, torch.full((batch, 20), 15.0))
    return logits.to(device)


def timed(fn, device: str, repeats: int) -> float:
    """Minimum wall time in ms over `repeats` runs after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def metadata(batch: int, top_k: int | None, top_p: float | None, device: str, seeded: bool) -> SamplingMetadata:
    gens = {i: make_generator(1000 + i, 7, device) for i in range(0, batch, 2)} if seeded else {}
    return SamplingMetadata(
        temperature=torch.full((batch,), 0.8, device=device),
        all_greedy=False,
        all_random=True,
        top_k=None if top_k is None else torch.full((batch,), top_k, dtype=torch.int64, device=device),
        top_p=None if top_p is None else torch.full((batch,), top_p, device=device),
        min_p=None,
        generators=gens,
        presence_penalties=None,
        frequency_penalties=None,
        repetition_penalties=None,
        prompt_token_ids=None,
        output_token_ids=[],
    )


def old_sampler(logits: torch.Tensor, md: SamplingMetadata, device: str) -> torch.Tensor:
    """The previous Sampler's random path: sort-based top-k/top-p, softmax, per-row-generator exponential race."""
    logits = logits.to(torch.float32, copy=True)
    apply_temperature(logits, md.temperature)
    apply_top_k_top_p_sort(logits, md.top_k, md.top_p)
    if md.min_p is not None:
        apply_min_p(logits, md.min_p)
    probs = logits.softmax(dim=-1)
    q = torch.empty_like(probs)
    if len(md.generators) < probs.shape[0]:
        q.exponential_()
    for row, seed_gen in md.generators.items():
        gen = torch.Generator(device=device).manual_seed(seed_gen.initial_seed())  # the old per-row device generator
        q[row].exponential_(generator=gen)
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = args.device
    out_path = args.out or f"benchmarks/out/sampling_micro_{device}.json"
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for kind in ("flat", "peaked"):
            logits = make_logits(batch, kind, device)
            for name, (top_k, top_p) in FEATURES.items():
                if name == "plain" and kind == "peaked":
                    continue  # plain sampling does not depend on the distribution's shape
                k = None if top_k is None else torch.full((batch,), top_k, dtype=torch.int64, device=device)
                p = None if top_p is None else torch.full((batch,), top_p, device=device)
                row = {"device": device, "batch": batch, "vocab": VOCAB, "logits": kind, "features": name}
                if name != "plain":
                    row["topk_topp_sort_ms"] = timed(
                        lambda x=logits, k=k, p=p: apply_top_k_top_p_sort(x.clone(), k, p), device, args.repeats
                    )
                    row["topk_topp_new_ms"] = timed(
                        lambda x=logits, k=k, p=p: apply_top_k_top_p(x.clone(), k, p), device, args.repeats
                    )
                    kept = torch.isfinite(apply_top_k_top_p(logits.clone(), k, p)).sum(-1).float().mean().item()
                    row["mean_kept_tokens"] = kept
                md = metadata(batch, top_k, top_p, device, seeded=True)
                sampler = Sampler()
                row["sampler_before_ms"] = timed(
                    lambda x=logits, md=md: old_sampler(x, md, device), device, args.repeats
                )
                row["sampler_after_ms"] = timed(lambda x=logits, md=md, s=sampler: s(x, md), device, args.repeats)
                rows.append(row)
                print(json.dumps(row), flush=True)

    def fmt(x):
        return f"{x:10.1f}" if x is not None else f"{'-':>10}"

    print(
        f"\n{'B':>4} {'logits':>7} {'features':>20} {'kept':>8} {'sort ms':>10} {'new ms':>10} "
        f"{'samp.before':>12} {'samp.after':>11}"
    )
    for r in rows:
        kept = r.get("mean_kept_tokens")
        print(
            f"{r['batch']:>4} {r['logits']:>7} {r['features']:>20} {'-' if kept is None else round(kept):>8} "
            f"{fmt(r.get('topk_topp_sort_ms'))} {fmt(r.get('topk_topp_new_ms'))} "
            f"{r['sampler_before_ms']:12.1f} {r['sampler_after_ms']:11.1f}"
        )
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()

"""Times the LoRA shrink/expand pair per layer shape and token count inside CUDA graphs: LoRALinear's split-K pair against the one-launch-per-width kernel and one-knob variants, beside the base layer's own GEMM.

Tokens read 4 adapter slots, rank 16, bf16, in three patterns: round-robin (a decode batch of
requests assigned round-robin, as offline_throughput.py --num-loras 4 sends them), sorted (the
same tokens already grouped by slot) and chunks (512-token runs per slot: a prefill step). The
kernels take the tokens grouped by slot (token_order) unless the variant says no-order. Each measurement captures CALLS_PER_GRAPH back-to-back pairs in one
CUDA graph and replays it (decode runs under graphs, so launch overhead is not what is measured).
Per token count the table adds the four layers up times the model's layer count: the LoRA cost
of one step, next to the base projections' cost. Each variant's output is checked against the
torch reference first. Prints a table; writes every timing as JSON.

    python benchmarks/lora_kernels.py --json-out benchmarks/out/h200-lora-kernels.json
"""

from __future__ import annotations

import argparse
import json
import subprocess

import torch

import engine.kernels.lora as lora_kernels
from engine.kernels.lora import lora_expand_triton, lora_num_splits, lora_shrink_triton
from engine.lora.ops import lora_expand_slots_ref, lora_shrink_slots_ref

# model -> (layer count, [(layer, in_features, output slice widths)]): the LoRA layers of one decoder layer.
MODELS = {
    "qwen3-0.6b": (28, [("qkv", 1024, (2048, 1024, 1024)), ("o", 2048, (1024,)),
                        ("gate_up", 1024, (3072, 3072)), ("down", 3072, (1024,))]),
    "qwen2.5-7b": (28, [("qkv", 3584, (3584, 512, 512)), ("o", 3584, (3584,)),
                        ("gate_up", 3584, (18944, 18944)), ("down", 18944, (3584,))]),
}
MAX_LORAS, RANK = 4, 16
CALLS_PER_GRAPH = 20
REPLAYS = 5


def graph_time_us(fn) -> float:
    """Median microseconds of one fn() call, CALLS_PER_GRAPH of them captured in a CUDA graph."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    return sorted(times)[len(times) // 2]


def token_slots(num_tokens: int, pattern: str) -> torch.Tensor:
    """round-robin: token t reads slot t % 4 (a decode batch of requests assigned round-robin);
    sorted: the same tokens grouped by slot (what reordering a step's tokens by adapter would give);
    chunks: runs of 512 tokens per slot (a prefill step of whole prompts)."""
    t = torch.arange(num_tokens, device="cuda")
    if pattern == "round-robin":
        slots = t % MAX_LORAS
    elif pattern == "sorted":
        slots = (t % MAX_LORAS).sort().values
    else:
        slots = (t // 512) % MAX_LORAS
    return slots.to(torch.int32)


def measure(k: int, widths: tuple[int, ...], num_tokens: int, pattern: str, variants: dict[str, tuple]) -> dict:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(k + num_tokens)
    a = (torch.randn(MAX_LORAS, len(widths) * RANK, k, device=dev, generator=g) / k**0.5).to(torch.bfloat16)
    b = (torch.randn(MAX_LORAS, sum(widths), RANK, device=dev, generator=g) / RANK**0.5).to(torch.bfloat16)
    w = (torch.randn(sum(widths), k, device=dev, generator=g) / k**0.5).to(torch.bfloat16)
    x = torch.randn(num_tokens, k, device=dev, generator=g).to(torch.bfloat16)
    y = torch.randn(num_tokens, sum(widths), device=dev, generator=g).to(torch.bfloat16)
    slots = token_slots(num_tokens, pattern)
    ref_buf = lora_shrink_slots_ref(x.float(), a.float(), slots, torch.empty(num_tokens, a.shape[1], device=dev))
    want = y.float()
    lora_expand_slots_ref(ref_buf, b.float(), slots, want, 0, widths)
    row = {"base_gemm_us": graph_time_us(lambda: torch.matmul(x, w.t()))}
    order = torch.argsort(slots, stable=True).to(torch.int32)  # as make_lora_mapping and the CUDA graphs group them
    for name, (num_splits, knobs, ordered) in variants.items():
        saved = {knob: getattr(lora_kernels, knob) for knob in knobs}
        for knob, value in knobs.items():
            setattr(lora_kernels, knob, value)
        buf = (torch.empty(num_tokens, a.shape[1], device=dev, dtype=torch.bfloat16) if num_splits == 0 else
               torch.empty(num_splits, num_tokens, a.shape[1], device=dev, dtype=torch.float32))
        out = y.clone()

        token_order = order if ordered else None

        def shrink():
            lora_shrink_triton(x, a, slots, buf, token_order)

        def expand():
            lora_expand_triton(buf, b, slots, out, 0, widths, token_order)

        def pair():
            shrink()
            expand()

        pair()
        delta, want_delta = (out.float() - y.float()).double(), (want - y.float()).double()
        err = float((delta - want_delta).norm() / want_delta.norm())
        assert err < 2e-2, f"{name}: relative error {err:.3g} against the reference"
        row[name] = {"num_splits": max(1, num_splits), "token_order": ordered, **knobs, "us": graph_time_us(pair),
                     "rel_err": err}
        if name == "default":
            row[name].update(shrink_us=graph_time_us(shrink), expand_us=graph_time_us(expand))
        for knob, value in saved.items():
            setattr(lora_kernels, knob, value)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 64, 256, 8192])
    parser.add_argument("--json-out", default="benchmarks/out/lora-kernels.json")
    args = parser.parse_args()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    results = {"device": torch.cuda.get_device_name(), "uptime": load, "max_loras": MAX_LORAS, "rank": RANK,
               "rows": []}
    for model, (num_layers, layers) in MODELS.items():
        if model not in args.models:
            continue
        for num_tokens in args.num_tokens:
            for pattern in (["round-robin", "sorted"] if num_tokens <= 256 else ["chunks"]):
                step = {}
                for layer, k, widths in layers:
                    # whole: one launch over the whole width, bf16 buffer, tokens as they come (the kernel
                    # before split-K); default: what LoRALinear runs; the others change one thing of it.
                    splits = lora_num_splits(k)
                    variants = {"whole": (0, {}, False), "default": (splits, {}, True),
                                "no-order": (splits, {}, False),
                                "expand-n64": (splits, {"EXPAND_MAX_BLOCK_N": 64}, True),
                                "expand-w2": (splits, {"EXPAND_NUM_WARPS": 2}, True),
                                "shrink-w2": (splits, {"SHRINK_NUM_WARPS": 2}, True)}
                    row = measure(k, widths, num_tokens, pattern, variants)
                    results["rows"].append({"model": model, "layer": layer, "num_tokens": num_tokens,
                                            "pattern": pattern, **row})
                    for key, value in row.items():
                        if key == "base_gemm_us":
                            step[key] = step.get(key, 0.0) + value
                            continue
                        step[key] = step.get(key, 0.0) + value["us"]
                        for part in ("shrink_us", "expand_us"):
                            if part in value:
                                step[part] = step.get(part, 0.0) + value[part]
                per_step = {n: v * num_layers / 1e3 for n, v in step.items()}
                cells = "  ".join(f"{n} {v:6.3f}" for n, v in per_step.items() if n != "base_gemm_us")
                print(f"{model:10s} T={num_tokens:5d} {pattern:11s} ms/step: base GEMMs {per_step['base_gemm_us']:6.3f}  "
                      f"LoRA {cells}", flush=True)
                results["rows"].append({"model": model, "num_tokens": num_tokens, "pattern": pattern,
                                        "per_step_ms": per_step})
    with open(args.json_out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"uptime: {load}\nwrote {args.json_out}")


if __name__ == "__main__":
    main()

"""Times the LoRA shrink/expand pair per layer shape and token count inside CUDA graphs: one launch of the whole width against split-K shrinks, beside the base layer's own GEMM.

Tokens read 4 adapter slots round-robin (as offline_throughput.py --num-loras 4 sends its
requests), rank 16, bf16. Each measurement captures CALLS_PER_GRAPH back-to-back pairs in one CUDA
graph and replays it (decode runs under graphs, so launch overhead is not what is measured).
Per token count the table adds the four layers up times the model's layer count: the LoRA
cost of one step, next to the base projections' cost. Each variant's output is checked against
the torch reference first. Prints a table; writes every timing as JSON.

    python benchmarks/lora_kernels.py --json-out benchmarks/out/h200-lora-kernels.json
"""

from __future__ import annotations

import argparse
import json
import subprocess

import torch

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


def measure(k: int, widths: tuple[int, ...], num_tokens: int, variants: dict[str, int]) -> dict:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(k + num_tokens)
    a = (torch.randn(MAX_LORAS, len(widths) * RANK, k, device=dev, generator=g) / k**0.5).to(torch.bfloat16)
    b = (torch.randn(MAX_LORAS, sum(widths), RANK, device=dev, generator=g) / RANK**0.5).to(torch.bfloat16)
    w = (torch.randn(sum(widths), k, device=dev, generator=g) / k**0.5).to(torch.bfloat16)
    x = torch.randn(num_tokens, k, device=dev, generator=g).to(torch.bfloat16)
    y = torch.randn(num_tokens, sum(widths), device=dev, generator=g).to(torch.bfloat16)
    slots = (torch.arange(num_tokens, device=dev) % MAX_LORAS).to(torch.int32)
    ref_buf = lora_shrink_slots_ref(x.float(), a.float(), slots, torch.empty(num_tokens, a.shape[1], device=dev))
    want = y.float()
    lora_expand_slots_ref(ref_buf, b.float(), slots, want, 0, widths)
    row = {"base_gemm_us": graph_time_us(lambda: torch.matmul(x, w.t()))}
    for name, num_splits in variants.items():
        buf = (torch.empty(num_tokens, a.shape[1], device=dev, dtype=torch.bfloat16) if num_splits == 0 else
               torch.empty(num_splits, num_tokens, a.shape[1], device=dev, dtype=torch.float32))
        out = y.clone()

        def pair():
            lora_shrink_triton(x, a, slots, buf)
            lora_expand_triton(buf, b, slots, out, 0, widths)

        pair()
        delta, want_delta = (out.float() - y.float()).double(), (want - y.float()).double()
        err = float((delta - want_delta).norm() / want_delta.norm())
        assert err < 2e-2, f"{name}: relative error {err:.3g} against the reference"
        row[name] = {"num_splits": max(1, num_splits), "us": graph_time_us(pair), "rel_err": err}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048, 8192])
    parser.add_argument("--json-out", default="benchmarks/out/lora-kernels.json")
    args = parser.parse_args()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    results = {"device": torch.cuda.get_device_name(), "uptime": load, "max_loras": MAX_LORAS, "rank": RANK,
               "rows": []}
    for model, (num_layers, layers) in MODELS.items():
        if model not in args.models:
            continue
        for num_tokens in args.num_tokens:
            step = {}
            for layer, k, widths in layers:
                # whole: one launch over the whole width, bf16 buffer (the kernel before split-K);
                # split-Nk: float32 partials over ranges of about N columns; default: what LoRALinear uses.
                variants = {"whole": 0, "default": lora_num_splits(k),
                            "split-128": lora_num_splits(k, 128, 64), "split-512": lora_num_splits(k, 512, 64)}
                row = measure(k, widths, num_tokens, variants)
                results["rows"].append({"model": model, "layer": layer, "num_tokens": num_tokens, **row})
                for key, value in row.items():
                    step[key] = step.get(key, 0.0) + (value if key == "base_gemm_us" else value["us"])
            names = [n for n in step if n != "base_gemm_us"]
            cells = "  ".join(f"{n} {step[n] * num_layers / 1e3:7.3f} ms" for n in names)
            print(f"{model:11s} T={num_tokens:5d}  base GEMMs {step['base_gemm_us'] * num_layers / 1e3:7.3f} ms/step  "
                  f"LoRA pair: {cells}", flush=True)
            results["rows"].append({"model": model, "num_tokens": num_tokens, "per_step_ms": {
                n: v * num_layers / 1e3 for n, v in step.items()}})
    with open(args.json_out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"uptime: {load}\nwrote {args.json_out}")


if __name__ == "__main__":
    main()

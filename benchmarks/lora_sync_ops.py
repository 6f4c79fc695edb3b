"""The device ops of one rank-r adapter sync, one at a time: host time per call and kernels launched.

An adapter sync of a 28-layer model moves ~400 small tensors, so its cost is the host's per-op and per-tensor
work, not bytes. This times, on the shape's real adapter tensors (every projection, bfloat16 as a trainer
holds them), each op the ipc sync path runs: the trainer's fill of its buffer, the engine's landing into
float32 staging, the finite check, and the rewrite of the slot regions (A copied, B scaled, cast to the slot's
dtype), each as one multi-tensor op and as the per-tensor loop it replaces, plus the single flat copy that
replaces the landing when the backend hands the call over flat. Host ms = enqueue time per call (the device
is not the limit at these sizes), "with sync" adds the wait for the device.

    python benchmarks/lora_sync_ops.py --device cuda --shape qwen3-0.6b --rank 16

Table on stdout, JSON at --json-out with the load before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import LORA_TARGETS, lora_module_shapes, shape_config  # noqa: E402
from workload import load, write_json  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--calls", type=int, default=100, help="timed calls per op (after 5 warm-up calls)")
    p.add_argument("--json-out", default="benchmarks/out/lora_sync_ops.json")
    return p.parse_args()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kernels(fn, device: torch.device) -> int | None:
    """CUDA kernels (and memcpys) one call launches; None on CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def measure(fn, device: torch.device, calls: int) -> dict:
    for _ in range(5):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    _sync(device)
    total = time.perf_counter() - start
    return {"host_ms": host / calls * 1e3, "with_sync_ms": total / calls * 1e3, "kernels": _kernels(fn, device)}


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    with open(os.path.join(shape_config(args.shape), "config.json")) as f:
        config = json.load(f)
    modules = lora_module_shapes(config, LORA_TARGETS)
    r = args.rank
    shapes = [s for in_f, out_f in modules.values() for s in ((r, in_f), (out_f, r))]  # A, B per module, as PEFT
    numel = sum(a * b for a, b in shapes)
    numels = [a * b for a, b in shapes]

    def views(flat: torch.Tensor) -> list[torch.Tensor]:
        return [piece.view(shape) for piece, shape in zip(flat.split(numels), shapes)]

    trainer = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in shapes]  # separate tensors, as params
    buffer = torch.empty(numel, device=device, dtype=torch.bfloat16)  # the ipc buffer, end to end
    staging = torch.empty(numel, device=device, dtype=torch.float32)
    in_buffer, in_staging = views(buffer), views(staging)
    slot_dtype = torch.bfloat16
    slots = [torch.zeros(s, device=device, dtype=slot_dtype) for s in shapes]  # stand-ins for the slot regions
    a_slots, b_slots, a_staged, b_staged = slots[0::2], slots[1::2], in_staging[0::2], in_staging[1::2]
    scratch = [torch.empty(t.shape, device=device) for t in b_staged]

    def rewrite() -> None:  # what LoRAManager._rewrite_slot runs for a bfloat16 slot
        torch._foreach_copy_(scratch, b_staged)
        torch._foreach_mul_(scratch, 0.5)
        torch._foreach_copy_(a_slots + b_slots, a_staged + scratch)

    ops = {
        "trainer fill: multi-tensor copy": lambda: torch._foreach_copy_(in_buffer, trainer),
        "trainer fill: per-tensor copies": lambda: [d.copy_(s) for d, s in zip(in_buffer, trainer)],
        "trainer fill: dtype/shape check": lambda: [(t.dtype, t.shape) for t in trainer],
        "landing: multi-tensor copy + cast": lambda: torch._foreach_copy_(in_staging, in_buffer),
        "landing: one flat copy + cast": lambda: staging.copy_(buffer),
        "finite check: isfinite(sum)": lambda: torch.isfinite(staging.sum()),
        "slot rewrite: scratch scaling": rewrite,
        "slot rewrite: temporaries scaling": lambda: (torch._foreach_copy_(a_slots, a_staged),
                                                      torch._foreach_copy_(b_slots, torch._foreach_mul(b_staged, 0.5))),
        "slot rewrite: per-tensor loop": lambda: [d.copy_(s * 0.5) for d, s in zip(slots, in_staging)],
    }
    load_before = load()
    results = {}
    print(f"{args.shape} rank {r}: {len(shapes)} tensors, {numel:,} values, {args.device}")
    print(f"{'op':40s} {'host ms':>9s} {'with sync':>10s} {'kernels':>8s}")
    for name, fn in ops.items():
        results[name] = measure(fn, device, args.calls)
        row = results[name]
        print(f"{name:40s} {row['host_ms']:9.3f} {row['with_sync_ms']:10.3f} {row['kernels']!s:>8}")
    write_json(args.json_out, {
        "benchmark": "lora_sync_ops", "device": args.device, "shape": args.shape, "rank": r,
        "num_tensors": len(shapes), "numel": numel, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "load_before": load_before, "load_after": load(), "results": results,
    })


if __name__ == "__main__":
    main()

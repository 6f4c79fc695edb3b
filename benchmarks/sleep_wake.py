"""Sleep and wake-up on the GPU: time of sleep(level) and wake_up against the pinned-copy floor, memory freed, and bit-identical outputs.

For each model shape (random bf16 weights, never downloaded) and level, an EngineCore (in this
process) sleeps and wakes `--cycles` times; each cycle records the wall time of sleep(level) and of
wake_up() (the call, device synchronized), the device memory the sleep gave back (cudaMemGetInfo:
what another process could now allocate) as a share of what the engine held, and whether a greedy
batch (`--batch-sizes`, 190-token prompts, 32 new tokens, with the sampled tokens' logprobs) gives
bit-identical tokens and logprobs after the wake-up. After level 2 the weights were discarded: the
engine must refuse to generate until the checkpoint's tensors (held on the device, as a trainer
holds its own) are pushed with a weight update (timed on its own), and then serve them exactly. The batch also runs three times without
sleeping first (the reference for all comparisons). The prefix cache is reset after every batch,
so each batch computes its prompts (a cache hit computes differently: issue 28, not this one).
The floor: the weights' bytes over the pinned host<->device bandwidth measured in the same run
(level 1 copies the weights out and back; level 2 and the KV cache copy nothing).

    python benchmarks/sleep_wake.py --shapes qwen3-0.6b qwen2.5-7b --json-out sleep_wake.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_common import median, shape_checkpoint, timed, weight_bytes  # noqa: E402
from engine.engine_args import create_engine_config  # noqa: E402
from engine.engine_core import EngineCore  # noqa: E402
from engine.exceptions import EngineNotReadyError  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.wire import EngineCoreRequest  # noqa: E402


def pinned_bandwidth(num_bytes: int) -> tuple[float, float]:
    """(host->device, device->host) bytes/s of one pinned copy of num_bytes (median of 5 after a warm-up)."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    rates = []
    for dst, src in ((dev, host), (host, dev)):
        times = []
        for i in range(6):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - start)
        rates.append(num_bytes / median(times))
    del host, dev
    torch.cuda.empty_cache()
    return rates[0], rates[1]


def device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def what_remains(worker, not_the_engines: int) -> dict[str, int]:
    """Where the device memory an asleep engine keeps lies, by the caching allocator's segments: CUDA graphs'
    private pools, live tensors in the default pool (buffers such as rotary caches, the runner's persistent
    inputs, cuBLAS workspaces; less `not_the_engines` bytes of this script's own tensors) and cached free blocks."""
    graph_pools = default_live = default_free = 0
    for seg in torch.cuda.memory_snapshot():
        live = sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            graph_pools += seg["total_size"]
        else:
            default_live += live
            default_free += seg["total_size"] - live
    buffers = sum(b.numel() * b.element_size() for b in worker.model.buffers() if b.is_cuda)
    return dict(graph_pools=graph_pools, live_tensors=default_live - not_the_engines, model_buffers=buffers,
                cached_free=default_free)


def run_batch(core: EngineCore, prompts: list[list[int]], tag: str) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{tag}-{i}", prompt, params, eos_token_id=None))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.new_logprobs is not None:
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs.logprobs[:, 0].tolist())
    core.reset_prefix_cache()
    return [(tokens[f"{tag}-{i}"], logprobs.get(f"{tag}-{i}", [])) for i in range(len(prompts))]


def refuses_generation(core: EngineCore) -> bool:
    """True if a request is refused because sleep(2) discarded the weights."""
    try:
        core.add_request(EngineCoreRequest("refused", [1, 2, 3], SamplingParams(max_tokens=1), eos_token_id=None))
    except EngineNotReadyError as e:
        return e.reason == "weights_discarded"
    core.abort_requests(["refused"])
    return False


def push(core: EngineCore, state: dict[str, torch.Tensor], version: str) -> None:
    core.start_weight_update()
    core.update_weights({"weights": state})
    core.finish_weight_update(weight_version=version)


def same(a, b) -> int:
    """How many requests of two runs have bit-identical tokens and logprobs."""
    return sum(x == y for x, y in zip(a, b, strict=True))


def bench_shape(shape: str, args, h2d: float, d2h: float) -> list[dict]:
    path = shape_checkpoint(shape)
    gen = torch.Generator().manual_seed(0)
    batches = {n: [torch.randint(10, 150000, (190,), generator=gen).tolist() for _ in range(n)]
               for n in args.batch_sizes}
    torch.cuda.init()
    torch.cuda.empty_cache()  # what an earlier shape left cached is not this engine's
    used_before_engine = device_used()
    start = time.perf_counter()
    core = EngineCore(create_engine_config(
        model=path, max_model_len=1024, device="cuda", max_num_seqs=max(args.batch_sizes),
        gpu_memory_utilization=args.gpu_memory_utilization, sleep_fixed_addresses=not args.allocator,
        enable_sleep_mode=not args.lazy_host_buffer,
    ))
    engine_start_s = time.perf_counter() - start  # with enable_sleep_mode, the pinned host copy is made in here
    worker = core.executor.worker
    weights = weight_bytes(worker.model)
    print(f"{shape:>13} engine start {engine_start_s:.2f} s (pinned host copy made at start-up: {not args.lazy_host_buffer})", flush=True)
    floor_s = {1: weights / d2h, 2: 0.0}, {1: weights / h2d, 2: 0.0}  # (sleep, wake_up)
    # The checkpoint's tensors on the device, pushed after each level-2 wake-up as a trainer's would be.
    # They are this script's (the trainer's), not the engine's: the memory accounting leaves them out.
    state = load_file(os.path.join(path, "model.safetensors"), device="cuda")
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    core.init_weight_transfer_engine({"backend": "local"})
    reference = {n: run_batch(core, p, f"ref{n}") for n, p in batches.items()}
    repeat_same = {n: min(same(reference[n], run_batch(core, p, f"rep{n}-{r}")) for r in range(2))
                   for n, p in batches.items()}
    graphs = worker.model_runner.cuda_graphs
    rows = []
    for level in args.levels:
        for cycle in range(args.cycles):
            # The engine's footprint now, not at start-up: running batches and updates grow its allocator's cache.
            used = device_used()
            engine_bytes = used - used_before_engine - state_bytes
            sleep_s = timed(lambda: core.sleep(level))
            gc.collect()
            reserved_asleep = torch.cuda.memory_reserved()  # the caching allocator's: graph pools, workspaces
            remains = what_remains(worker, state_bytes)
            freed = used - device_used()
            remaining = engine_bytes - freed
            wake_s = timed(lambda: core.wake_up())
            refused = update_s = None
            if level == 2:  # the weights were discarded: refused until the trainer's (here the same) weights land
                refused = refuses_generation(core)
                update_s = timed(lambda: push(core, state, f"l2c{cycle}"))
            outputs = {n: same(reference[n], run_batch(core, p, f"l{level}c{cycle}-{n}")) for n, p in batches.items()}
            rows.append(dict(
                shape=shape, level=level, cycle=cycle, sleep_s=sleep_s, wake_up_s=wake_s,
                refused_until_update=refused, update_after_wake_s=update_s,
                sleep_floor_s=floor_s[0][level], wake_up_floor_s=floor_s[1][level],
                freed_bytes=freed, engine_bytes=engine_bytes, freed_share=freed / engine_bytes,
                remaining_bytes=remaining, allocator_reserved_asleep=reserved_asleep, remains=remains,
                graphs_kept=worker.model_runner.cuda_graphs is graphs,
                identical={str(n): f"{outputs[n]}/{n}" for n in batches},
                repeated_without_sleep={str(n): f"{repeat_same[n]}/{n}" for n in batches},
                weights_bytes=weights, fixed_addresses=worker.weight_region is not None,
                engine_start_s=engine_start_s, host_buffer_at_start=not args.lazy_host_buffer,
            ))
            r = rows[-1]
            print(f"{shape:>13} L{level} #{cycle}  sleep {1e3 * sleep_s:8.1f} ms (floor {1e3 * r['sleep_floor_s']:6.1f})"
                  f"  wake_up {1e3 * wake_s:8.1f} ms (floor {1e3 * r['wake_up_floor_s']:6.1f})"
                  f"  freed {100 * r['freed_share']:6.2f}% ({remaining / 2**20:7.1f} MiB left: "
                  + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in remains.items()) + " MiB)"
                  f"  graphs kept {r['graphs_kept']}  identical {r['identical']}  no-sleep {r['repeated_without_sleep']}"
                  + (f"  refused until update {refused}, update {1e3 * update_s:.1f} ms" if level == 2 else ""),
                  flush=True)
    core.shutdown()
    del core, worker, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "qwen2.5-7b"])
    parser.add_argument("--levels", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[8, 64])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="weights + KV cache share")
    parser.add_argument("--allocator", action="store_true", help="sleep_fixed_addresses off (the old way), as the peer")
    parser.add_argument("--lazy-host-buffer", action="store_true",
                        help="enable_sleep_mode off: the first sleep(1) allocates the pinned host copy")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    h2d, d2h = pinned_bandwidth(1 << 30)
    print(f"pinned copy: host->device {h2d / 1e9:.1f} GB/s, device->host {d2h / 1e9:.1f} GB/s; load: {load}")
    rows = [row for shape in args.shapes for row in bench_shape(shape, args, h2d, d2h)]
    result = dict(device=torch.cuda.get_device_name(), load=load, pinned_h2d_bytes_per_s=h2d,
                  pinned_d2h_bytes_per_s=d2h, fixed_addresses=not args.allocator, rows=rows)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

"""Weight sync: seconds per sync and GB/s for each backend, from send_weights() start to the engine serving the new version.

The engine runs in its own process (RolloutWorker(multiprocess=True), or a RolloutWorker Ray actor
for sharded_rdt) with the model's checkpoint; the trainer is this process and holds random
weights of the same shapes (on the engine's device). Each backend does one warm-up sync (buffers
are allocated and exported, process groups formed) and then --syncs timed syncs, each of freshly
changed weights; the engine's version is checked after every sync and its checksums after the last.

--lora-rank R adds, on the same engine (started with enable_lora) and trainer, adapter syncs: a random
PEFT adapter of rank R on --lora-targets of the model's shape is written to a temp dir and loaded
(add_lora), and its tensors (adapter_source, --lora-dtype) are synced --lora-syncs times after one
warm-up, each timed from send_weights() start to the engine serving the adapter's new version; a
row beside the model's full sync says the bytes and time of each.

    python benchmarks/weight_sync.py                                   # CPU: every backend, tiny and ~100M
    python benchmarks/weight_sync.py --device cuda --backends ipc --models qwen3-0.6b qwen2.5-1.5b qwen2.5-7b
    python benchmarks/weight_sync.py --device cuda --backends ipc --models qwen3-0.6b qwen2.5-7b --lora-rank 16
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import os
import platform
import socket
import signal
import statistics
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import load, resolve_model, write_json  # noqa: E402

CPU_BACKENDS = ["local", "nccl", "nccl-unpacked", "sparse_nccl", "ipc", "sharded_rdt"]
# Backends that sync adapters (engine/worker/lora_weight_update.py): sparse_nccl sends coordinate patches and
# sharded_rdt plans pulls through the model's weight loaders, and the engine refuses adapters from both.
LORA_BACKENDS = {"local", "nccl", "nccl-unpacked", "ipc"}
LORA_NAME = "bench"
# ~100M parameters: 12 llama layers of width 768 and a 8192-token vocabulary (untied head).
CPU_SHAPES = {
    "100m": ("llama", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                           intermediate_size=2048, vocab_size=8192, tie_word_embeddings=False)),
    # Qwen3-0.6B's 28 layers at a small width: its adapter's 392 tensors (rank 16, 7 targets), so per-tensor and
    # per-call costs weigh as they do on the GPU shape while the bytes stay few.
    "28-layer": ("llama", dict(hidden_size=64, num_hidden_layers=28, num_attention_heads=2, num_key_value_heads=1,
                               intermediate_size=128, vocab_size=1024, tie_word_embeddings=True)),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--backends", nargs="+", default=None, help=f"default on CPU: {' '.join(CPU_BACKENDS)}; on CUDA: ipc")
    p.add_argument("--models", nargs="+", default=None,
                   help="tiny-llama, 100m, 28-layer (CPU), qwen3-0.6b, qwen2.5-1.5b, qwen2.5-7b "
                        "(GPU shapes, random bf16 weights)")
    p.add_argument("--syncs", type=int, default=3, help="timed syncs per backend and model (after one warm-up)")
    p.add_argument("--buffer-mib", type=int, default=256, help="packed buffer size for packed backends")
    p.add_argument("--sparse-fraction", type=float, default=0.01, help="sparse_nccl: fraction of coordinates changed per sync")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--skip-checksums", action="store_true",
                   help="skip the final checksum comparison (always skipped above 4 GB of weights)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="mark each timed sync's hops in the trainer's and the engine's processes into FILE "
                        "(weight_transfer/sync_trace.py) and report each hop's median ms after the sync's start")
    p.add_argument("--stuck-dump-s", type=float, default=60.0,
                   help="a sync still running after this many seconds prints every thread's stack of this process "
                        "and (SIGUSR1) of the engine's processes, then goes on; 0: never")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="also sync a random LoRA adapter of this rank into the same engine (0: full weights only)")
    p.add_argument("--lora-targets", nargs="+", default=None,
                   help="--lora-rank: the projections adapted (default: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)")
    p.add_argument("--lora-syncs", type=int, default=20, help="--lora-rank: timed adapter syncs (after one warm-up)")
    p.add_argument("--lora-dtype", default=None, choices=["float32", "bfloat16"],
                   help="--lora-rank: the trainer's adapter tensors (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--json-out", default="benchmarks/out/weight_sync.json")
    args = p.parse_args()
    if args.lora_rank < 0 or args.lora_syncs < 1:
        p.error("--lora-rank must be >= 0 and --lora-syncs >= 1")
    if args.lora_dtype is None:
        args.lora_dtype = "bfloat16" if args.device == "cuda" else "float32"
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_path(name: str, device: str) -> str:
    if name in CPU_SHAPES:
        from engine.tiny_models import make_tiny_checkpoint

        arch, overrides = CPU_SHAPES[name]
        path = f"/tmp/rollout-bench/{name}"
        if not os.path.exists(f"{path}/model.safetensors"):
            make_tiny_checkpoint(path, arch, **overrides)
        return path
    if device == "cuda" and not name.startswith("tiny"):
        from gpu_common import shape_config

        return shape_config(name)  # weights: load_format="dummy" (random), nothing to write or read
    return resolve_model(name)


def trainer_state(weights: dict, device: str, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors with the engine's HF names, shapes and dtypes, on `device` (norms near 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, meta in weights.items():
        dtype = getattr(torch, meta["dtype"])
        t = torch.empty(meta["shape"], dtype=dtype, device=device)
        t.normal_(1.0 if "norm" in name else 0.0, 0.02, generator=gen)
        state[name] = t
    return state


def perturb(state: dict[str, torch.Tensor], fraction: float, seed: int) -> None:
    """Changes `fraction` of every tensor's coordinates in place (1.0: all of them)."""
    # The noise is drawn on the tensors' device: drawing 7B values on the CPU took minutes per sync.
    gens: dict[torch.device, torch.Generator] = {}
    for t in state.values():
        gen = gens.get(t.device)
        if gen is None:
            gen = gens[t.device] = torch.Generator(device=t.device).manual_seed(seed)
        flat = t.view(-1)
        if fraction >= 1.0:
            flat.add_(torch.randn(flat.shape, generator=gen, device=t.device, dtype=t.dtype), alpha=1e-3)
            continue
        k = max(1, int(flat.numel() * fraction))
        idx = torch.randint(0, flat.numel(), (k,), generator=gen, device=t.device)
        flat[idx] += (torch.randn(k, generator=gen, device=t.device) * 1e-2 + 1e-2).to(t.dtype)


def init_info_for(backend: str, args, world_size: int):
    buffer = args.buffer_mib << 20
    if backend == "local":
        from weight_transfer.local import LocalTrainerInitInfo

        return LocalTrainerInitInfo(encoding="tensors", max_bytes_per_call=buffer)
    if backend in ("nccl", "nccl-unpacked"):
        from weight_transfer.nccl import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=_free_port(), world_size=1 + world_size,
                                   packed=backend == "nccl", packed_buffer_size_bytes=buffer)
    if backend == "sparse_nccl":
        from weight_transfer.sparse_nccl import SparseNCCLTrainerInitInfo

        return SparseNCCLTrainerInitInfo(master_address="127.0.0.1", master_port=_free_port(),
                                         world_size=1 + world_size, packed_buffer_size_bytes=buffer)
    if backend == "ipc":
        from weight_transfer.ipc import IPCTrainerInitInfo

        return IPCTrainerInitInfo(packed_buffer_size_bytes=buffer)
    if backend == "sharded_rdt":
        from weight_transfer.sharded_rdt import ShardedRDTTrainerInitInfo

        return ShardedRDTTrainerInitInfo(chunk_bytes=min(buffer, 64 << 20))
    raise ValueError(f"--backends: unknown backend {backend!r}")


class Engine:
    """The engine under test in its own process, and the client that drives its weight lifecycle."""

    def __init__(self, path: str, args, ray_actor: bool, lora_rank: int = 0) -> None:
        from weight_transfer.clients import LocalWeightSyncClient, RayWeightSyncClient

        engine_args = dict(max_model_len=256, device=args.device, disable_log_stats=True)
        if lora_rank:
            engine_args.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank)
        if not os.path.exists(os.path.join(path, "model.safetensors")):
            engine_args["load_format"] = "dummy"
        if args.device == "cuda":
            # No CUDA graph capture: weights are updated in place either way, and start-up is shorter.
            engine_args.update(gpu_memory_utilization=args.gpu_memory_utilization, dtype="bfloat16", enforce_eager=True)
        else:
            engine_args.update(dtype="float32", num_gpu_blocks_override=64)
        self.ray_actor = ray_actor
        if ray_actor:
            import ray

            from rollout.worker import RolloutWorker

            if not ray.is_initialized():
                ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            self.worker = ray.remote(RolloutWorker).remote(model=path, multiprocess=False, **engine_args)
            self.client = RayWeightSyncClient([self.worker])
        else:
            from rollout.worker import RolloutWorker

            self.worker = RolloutWorker(model=path, multiprocess=True, **engine_args)
            self.client = LocalWeightSyncClient(self.worker)

    def weight_info(self) -> dict:
        return self.client.weight_info()

    def generate_one(self, lora_request=None) -> None:
        from engine import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        prompt = [{"prompt_token_ids": [5, 6, 7]}]
        if self.ray_actor:
            import ray

            ray.get(self.worker.generate.remote(prompt, params, lora_request=lora_request))
        else:
            self.worker.generate(prompt, params, lora_request=lora_request)

    def close(self) -> None:
        if self.ray_actor:
            import ray

            ray.get(self.worker.shutdown.remote())
            ray.kill(self.worker)
        else:
            self.worker.shutdown()


class _Watchdog:
    """One thread for every stuck_dump: starting a Timer thread per sync cost ~0.1-0.4 ms inside the timed region,
    a fifth of a 2 ms adapter sync's target."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: tuple[float, float, str] | None = None  # (deadline, after_s, what)
        self._thread: threading.Thread | None = None

    def arm(self, after_s: float, what: str) -> None:
        with self._cond:
            self._armed = (time.monotonic() + after_s, after_s, what)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stuck-dump", daemon=True)
                self._thread.start()
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._armed = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._armed is None or time.monotonic() < self._armed[0]:
                    self._cond.wait(None if self._armed is None else self._armed[0] - time.monotonic())
                _, after_s, what = self._armed
                self._armed = None
            _dump_stacks(after_s, what)


_WATCHDOG = _Watchdog()


def _dump_stacks(after_s: float, what: str) -> None:
    import psutil

    print(f"*** {what} still running after {after_s:g} s: stacks follow", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(all_threads=True)
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            # Engine processes and their workers (multiprocessing spawn children) print their stacks on
            # SIGUSR1; for any other process (the resource tracker) it would be fatal.
            if "spawn_main" in " ".join(child.cmdline()):
                os.kill(child.pid, signal.SIGUSR1)


@contextlib.contextmanager
def stuck_dump(after_s: float, what: str):
    """Prints where everything waits if the block runs longer than after_s: this process's threads,
    and the engine's processes' (they print their stacks on SIGUSR1)."""
    if after_s <= 0:
        yield
        return
    _WATCHDOG.arm(after_s, what)
    try:
        yield
    finally:
        _WATCHDOG.disarm()


def bench_one(backend: str, model: str, args) -> list[dict]:
    """The full-weight sync's row, and with --lora-rank (a backend that syncs adapters) the adapter sync's after it."""
    from weight_transfer import StateDictSource, trainer_init
    from weight_transfer.checksums import hf_state_checksums, lora_state_checksums

    path = model_path(model, args.device)
    lora_rank = args.lora_rank if backend in LORA_BACKENDS else 0
    engine = Engine(path, args, ray_actor=backend == "sharded_rdt", lora_rank=lora_rank)
    try:
        before = load()
        weights = engine.weight_info()["weights"]
        with open(os.path.join(path, "config.json")) as f:
            if json.load(f).get("tie_word_embeddings"):
                weights.pop("lm_head.weight", None)  # an alias of the embedding: sent once, as the embedding
        state = trainer_state(weights, args.device, seed=0)
        source = StateDictSource(state)
        dense_bytes = sum(t.numel() * t.element_size() for t in state.values())
        trainer = trainer_init(init_info_for(backend, args, engine.client.get_world_size()),
                               client=engine.client, source=source)
        start = time.perf_counter()
        with stuck_dump(args.stuck_dump_s, f"{backend} {model} warm-up sync"):
            warm = trainer.send_weights(weight_version="warmup")
        warm_s = time.perf_counter() - start
        fraction = args.sparse_fraction if backend == "sparse_nccl" else 1.0
        times, sent, phases = [], [], []
        _restart_trace(args)
        for i in range(args.syncs):
            perturb(state, fraction, seed=i + 1)
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with stuck_dump(args.stuck_dump_s, f"{backend} {model} sync {i}"):
                stats = trainer.send_weights(weight_version=f"v{i}")
            times.append(time.perf_counter() - start)
            sent.append(stats.bytes_sent)
            phases.append(stats.extra.get("phases_s", {}))
            assert engine.client.get_weight_version() == f"v{i}", "the engine serves the new version"
        engine.generate_one()  # and generates with it
        median = statistics.median(times)
        full = {
            "backend": backend, "model": model, "device": args.device, "weights": "full",
            "params": sum(t.numel() for t in state.values()),
            "dense_bytes": dense_bytes, "warmup_s": warm_s, "warmup_bytes_sent": warm.bytes_sent,
            "sync_s": times, "median_s": median, "gb_per_s": dense_bytes / median / 1e9,
            "bytes_sent_median": statistics.median(sent), "checksums_match": None,
            "phases_median_s": _phase_medians(phases), "enable_lora": bool(lora_rank), "load_before": before, "load_after": load(),
            "hops_median_ms": _trace_hops(args),
        }
        rows = [full]
        baseline = hf_state_checksums(state)
        if lora_rank:
            lora_row, adapter = bench_lora(engine, trainer, path, args, full)
            rows.append(lora_row)
            baseline |= lora_state_checksums(LORA_NAME, adapter)
        if not args.skip_checksums and dense_bytes < 4e9:  # sha256 of every tensor on the host: minutes for 7B
            # One check of both: the model's weights are the last full sync's, the adapter's its last sync's.
            report = engine.client.weight_checker(baseline)
            wrong = [*report["mismatches"], *report["missing"], *report["unexpected"]]
            full["checksums_match"] = not any(not k.startswith("lora:") for k in wrong)
            if lora_rank:
                rows[1]["checksums_match"] = not any(k.startswith("lora:") for k in wrong)
        trainer.shutdown()
        return rows
    finally:
        engine.close()
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def _phase_medians(phases: list[dict[str, float]]) -> dict[str, float]:
    """Median seconds of each phase (SyncStats.extra["phases_s"]): start_weight_update / the backend's send /
    finish_weight_update, or for a sync in one call (apply_weight_update) send / apply."""
    return {k: statistics.median(p[k] for p in phases) for k in (phases[0] if phases else {})}


def bench_lora(engine: Engine, trainer, path: str, args, full: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """Adapter syncs through the full sync's trainer and engine: (the row, the adapter's tensors as last synced)."""
    from gpu_common import LORA_TARGETS, random_peft_adapter
    from safetensors.torch import load_file

    from engine.lora.request import LoRARequest
    from weight_transfer.lora import adapter_source

    targets = args.lora_targets or LORA_TARGETS
    dtype = getattr(torch, args.lora_dtype)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        lora = LoRARequest(LORA_NAME, 1, random_peft_adapter(path, tmp, args.lora_rank, targets, dtype=dtype))
        engine.worker.add_lora(lora)  # read into the engine's host cache now: the directory may go afterwards
        # Serving before the syncs, so it holds a device slot and every sync rewrites it (as in training, where
        # the adapter generates between syncs); an adapter in no slot would skip that copy.
        engine.generate_one(lora)
        # The trainer's copy, on its device (a step's optimizer moves these between syncs).
        adapter = {name: t.to(args.device) for name, t in load_file(os.path.join(lora.lora_path,
                                                                                 "adapter_model.safetensors")).items()}
    source = adapter_source(adapter, LORA_NAME)
    what = f"{full['backend']} {full['model']} lora r{args.lora_rank}"
    before = load()
    start = time.perf_counter()
    with stuck_dump(args.stuck_dump_s, f"{what} warm-up sync"):
        warm = trainer.send_weights(source, weight_version="lora-warmup")
    warm_s = time.perf_counter() - start
    times, sent, phases = [], [], []
    _restart_trace(args)
    for i in range(args.lora_syncs):
        perturb(adapter, 1.0, seed=100 + i)
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with stuck_dump(args.stuck_dump_s, f"{what} sync {i}"):
            stats = trainer.send_weights(source, weight_version=f"lora-v{i}")
        times.append(time.perf_counter() - start)
        sent.append(stats.bytes_sent)
        phases.append(stats.extra.get("phases_s", {}))
        # The adapter serves its new version; the base model's stays the last full sync's.
        assert engine.client.get_weight_version(lora_name=LORA_NAME) == f"lora-v{i}"
    assert engine.client.get_weight_version() == f"v{args.syncs - 1}"
    engine.generate_one(lora)  # and generates with it
    median = statistics.median(times)
    dense_bytes = source.num_bytes
    row = {
        "backend": full["backend"], "model": full["model"], "device": args.device, "weights": f"lora r{args.lora_rank}",
        "lora_rank": args.lora_rank, "lora_targets": list(targets), "lora_dtype": args.lora_dtype,
        "params": sum(t.numel() for t in adapter.values()), "num_tensors": len(adapter),
        "dense_bytes": dense_bytes, "warmup_s": warm_s, "warmup_bytes_sent": warm.bytes_sent,
        "sync_s": times, "median_s": median, "median_ms": 1e3 * median, "gb_per_s": dense_bytes / median / 1e9,
        "bytes_sent_median": statistics.median(sent), "checksums_match": None,
        # start / send / finish, or send / apply for a sync in one engine call: median seconds each
        "phases_median_s": _phase_medians(phases),
        "full_sync_median_s": full["median_s"], "full_sync_dense_bytes": full["dense_bytes"],
        "time_vs_full_sync": median / full["median_s"], "bytes_vs_full_sync": dense_bytes / full["dense_bytes"],
        "load_before": before, "load_after": load(), "hops_median_ms": _trace_hops(args),
    }
    return row, adapter


def _restart_trace(args) -> None:
    """--trace: the timed syncs' marks start an empty file (the warm-up's and start-up's are dropped)."""
    if args.trace:
        open(args.trace, "w").close()  # the processes append to it (O_APPEND): truncating is safe between syncs


def _trace_hops(args) -> dict[str, float] | None:
    """--trace: each hop's median ms after its sync's start, over the syncs since _restart_trace."""
    if not args.trace:
        return None
    from weight_transfer import sync_trace

    return sync_trace.summarize(args.trace)


def main() -> None:
    args = parse_args()
    if args.trace:  # before any engine starts: its processes inherit it
        from weight_transfer import sync_trace

        sync_trace.enable(args.trace)
    backends = args.backends or (CPU_BACKENDS if args.device == "cpu" else ["ipc"])
    models = args.models or (["tiny-llama", "100m"] if args.device == "cpu" else ["qwen3-0.6b", "qwen2.5-1.5b", "qwen2.5-7b"])
    print(f"Weight sync ({args.device}; {args.syncs} timed syncs after a warm-up; median; send_weights() start "
          "to the engine serving the new version)")
    if args.lora_rank:
        print(f"LoRA adapter syncs: rank {args.lora_rank}, {args.lora_dtype}, {args.lora_syncs} timed after a warm-up, "
              f"into the same engine (enable_lora) through the same trainer; backends {' '.join(sorted(LORA_BACKENDS))}")
    print(f"{'backend':<14}{'model':<14}{'weights':<10}{'params':>14}{'MB':>10}{'warm-up s':>11}{'sync ms':>10}"
          f"{'GB/s':>8}{'sent %':>8}{'checksums':>11}", flush=True)
    rows = []
    for model in models:
        for backend in backends:
            for r in bench_one(backend, model, args):
                rows.append(r)
                print(f"{r['backend']:<14}{r['model']:<14}{r['weights']:<10}{r['params']:>14,}"
                      f"{r['dense_bytes'] / 1e6:>10.1f}{r['warmup_s']:>11.3f}{1e3 * r['median_s']:>10.2f}"
                      f"{r['gb_per_s']:>8.2f}{100 * r['bytes_sent_median'] / r['dense_bytes']:>8.1f}"
                      f"{str(r['checksums_match']):>11}", flush=True)
                for hop, ms in (r.get("hops_median_ms") or {}).items():
                    print(f"    {ms:8.3f} ms  {hop}")
            # Written after every backend, so a run cut short keeps what it measured.
            write_json(args.json_out, {
                "benchmark": "weight_sync", "device": args.device, "machine": platform.node(),
                "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                "lora_rank": args.lora_rank, "load": load(), "results": rows,
            })


if __name__ == "__main__":
    main()

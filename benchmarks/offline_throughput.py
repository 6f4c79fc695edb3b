"""Offline throughput: our engine against a peer (HF transformers generate(), or vLLM's LLM.generate) on the same random workload.

Prints a table (output tokens/s, ratios) and writes JSON with the machine's load (`uptime`).
Prompt and output lengths are drawn uniformly from ranges; every request runs to its max_tokens
(ignore_eos). --peer vllm runs vLLM in its own interpreter (--vllm-python, e.g. a venv with
vLLM's CPU build) through benchmarks/vllm_peer.py, on the same checkpoint, prompt ids and
output lengths, alternating with ours --repeats times. --busy-core adds runs while another
process keeps one core busy, to see what contention does to each engine.
--num-loras K --lora-rank R runs the same workload a second time on an engine serving K random
PEFT adapters of rank R (built offline under a temp dir), assigned to the requests round-robin,
and reports its throughput against the base model's (the first run, an engine without LoRA).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import load, make_workload, resolve_model, vocab_size_of, write_json  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="checkpoint directory or built-in tiny model name")
    p.add_argument("--shape", default=None, help="GPU: random-weight model of a published shape "
                   "(qwen3-0.6b, qwen2.5-7b), built under /tmp; overrides --model")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0: off); with --temperature > 0")
    p.add_argument("--hf-num-requests", type=int, default=None,
                   help="run HF generate() on only the first N requests (it is slow on long outputs)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--attention-order", choices=["rows", "longest"], default=None,
                   help="decode attention programs in row order or longest context first "
                        "(engine.kernels.attention.LONGEST_FIRST; default: the engine's; in-process engine only)")
    # Defaults: the nano-vllm workload (256 requests, prompt and output lengths uniform in
    # [100, 1024]) and the engine's default max_num_seqs; on the tiny model a 2-core CPU runs
    # it in about two minutes, HF included. HF's cost grows with the padded length (every
    # step attends over, and re-copies, the batch's longest context), so shorter ranges
    # narrow the gap (benchmarks/results/NOTES-cpu.md has both).
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--hf-batch-size", type=int, default=None, help="HF static batch size (default: max-num-seqs)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", help="ours: the KV cache's element type (auto or fp8)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true", help="no peer run (same as --peer none)")
    p.add_argument("--peer", choices=["hf", "vllm", "none"], default="hf",
                   help="what ours is compared with: HF generate() in this process, or vLLM in --vllm-python")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                   help="--peer vllm: the interpreter with vLLM installed (default: $VLLM_PYTHON)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30, help="--peer vllm: vLLM's KV cache size")
    p.add_argument("--repeats", type=int, default=1, help="run ours and the peer alternately this many times each")
    p.add_argument("--busy-core", action="store_true",
                   help="also run each engine while a competing process keeps one core busy")
    p.add_argument("--busy-core-cpu", type=int, default=None,
                   help="pin the competing process to this core (default: unpinned, the OS places it)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per engine (mp executor)")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engines behind one RolloutGroup, each on its own GPU(s); requests are balanced between them")
    p.add_argument("--frontend", choices=["llm", "group"], default="llm",
                   help="llm: the offline LLM class; group: a RolloutGroup (async frontend), forced above one engine")
    p.add_argument("--floor", action="store_true",
                   help="GPU: also the run's floor, step by step (gpu_common.StepFloor: bytes over the measured "
                        "copy bandwidth, FLOPs over the measured GEMM rate)")
    p.add_argument("--num-loras", type=int, default=0,
                   help="also run the workload with this many random LoRA adapters, round-robin over the requests")
    p.add_argument("--lora-rank", type=int, default=16, help="--num-loras: the adapters' rank")
    p.add_argument("--lora-targets", nargs="+", default=None,
                   help="--num-loras: the projections adapted (default: q k v o gate up down)")
    p.add_argument("--json-out", default="benchmarks/out/offline_throughput.json")
    args = p.parse_args()
    if args.num_loras < 0 or args.lora_rank < 1:
        p.error("--num-loras must be >= 0 and --lora-rank >= 1")
    if args.num_loras and (args.peer == "vllm" or args.frontend != "llm" or args.data_parallel_size > 1):
        p.error("--num-loras runs the in-process LLM (--frontend llm, one engine, --peer hf or none)")
    if args.skip_hf:
        args.peer = "none"
    if args.peer == "vllm":
        if not args.vllm_python:
            p.error("--peer vllm needs --vllm-python (or $VLLM_PYTHON): the interpreter of a venv with vLLM")
        if not os.access(args.vllm_python, os.X_OK):
            p.error(f"--vllm-python {args.vllm_python!r} is not an executable")
        if args.data_parallel_size > 1 or args.tensor_parallel_size > 1:
            p.error("--peer vllm compares one engine on one rank; drop --data/tensor-parallel-size")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.floor and not (torch.cuda.is_available() and args.device != "cpu"):
        p.error("--floor measures the GPU's copy bandwidth and GEMM rate: it needs CUDA")
    if args.floor and (args.frontend != "llm" or args.data_parallel_size > 1 or args.tensor_parallel_size > 1):
        p.error("--floor reads the in-process engine's steps: --frontend llm, one rank")
    return args


def run_engine(args, path: str, work, loras: list | None = None) -> dict:
    """Ours on the workload; with `loras` (LoRARequests), an engine serving them all, request i running loras[i % K]."""
    if args.data_parallel_size > 1 or args.frontend == "group":
        return run_group(args, path, work)
    from engine import LLM, SamplingParams

    extra = {"tensor_parallel_size": args.tensor_parallel_size}
    if loras:  # every adapter resident at once: the measurement is of mixed batches, not of paging
        extra.update(enable_lora=True, max_loras=len(loras), max_lora_rank=args.lora_rank)
    rates = None
    if args.floor:  # measured before the engine takes the device's memory
        from gpu_common import copy_bandwidth_bytes_per_s, matmul_flops_per_s

        rates = copy_bandwidth_bytes_per_s(), matmul_flops_per_s()
    if torch.cuda.is_available() and args.device != "cpu":
        extra.update(gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager)
    request_loras = [loras[i % len(loras)] for i in range(len(work))] if loras else None
    llm = LLM(path, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=args.kv_cache_dtype,
              max_model_len=args.input_len[1] + args.output_len[1], **extra)
    warm = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 4
    # Warm-up with the first four requests' adapters too: they are read and paged in, their kernels compiled.
    llm.generate([{"prompt_token_ids": p} for p, _ in work[:4]], warm, use_tqdm=False,
                 lora_request=request_loras[:4] if loras else None)
    llm.reset_prefix_cache()  # the warm-up prompts must not give the timed run cache hits

    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=n, ignore_eos=True)
              for _, n in work]
    floor = None
    if rates is not None:
        from gpu_common import StepFloor

        floor = StepFloor(llm, *rates)
    _sync(llm.config.device.resolve())
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=request_loras)
    _sync(llm.config.device.resolve())
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_out == sum(n for _, n in work), "every request runs to max_tokens"
    worker = getattr(llm.engine_core.executor, "worker", None)  # in-process (uni) executor only
    graphs = worker.model_runner.cuda_graphs if worker is not None else None
    result = {"elapsed_s": elapsed, "output_tokens": num_out, "output_tok_per_s": num_out / elapsed,
              "device": llm.config.device.resolve(), "dtype": str(_dtype(args, llm.config.device.resolve())),
              "num_kv_blocks": llm.engine_core.num_blocks, "tensor_parallel_size": args.tensor_parallel_size,
              "cuda_graph_replays": graphs.num_replays if graphs is not None else None}
    if floor is not None:
        result["floor"] = floor.summary(num_out, elapsed)
    llm.shutdown()  # its device memory is free when this returns: the next run in this process sizes its cache from it
    return result


def run_with_loras(args, path: str, work) -> dict:
    """The workload on an engine serving --num-loras random adapters of --lora-rank (built offline, deleted after)."""
    from gpu_common import LORA_TARGETS, random_peft_adapter

    from engine.lora.request import LoRARequest

    targets = args.lora_targets or LORA_TARGETS
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        # One seed each: different adapters, so a step's rows really run K different products.
        loras = [LoRARequest(f"bench-{i}", i + 1, random_peft_adapter(path, os.path.join(tmp, str(i)), args.lora_rank,
                                                                      targets, seed=i))
                 for i in range(args.num_loras)]
        adapter_bytes = sum(os.path.getsize(os.path.join(lora.lora_path, "adapter_model.safetensors")) for lora in loras)
        result = run_engine(args, path, work, loras)
    return {**result, "num_loras": args.num_loras, "lora_rank": args.lora_rank, "lora_targets": list(targets),
            "assignment": "round-robin", "adapter_file_bytes": adapter_bytes}


def run_group(args, path: str, work) -> dict:
    """The same workload through a RolloutGroup of data_parallel_size engines (each its own process and GPU)."""
    import asyncio

    from engine import SamplingParams
    from rollout.group import RolloutGroup

    extra = {}
    if torch.cuda.is_available() and args.device != "cpu":
        extra = dict(gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager)
    group = RolloutGroup.from_engine_args(
        data_parallel_size=args.data_parallel_size, model=path, dtype=args.dtype, device=args.device,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.input_len[1] + args.output_len[1], tensor_parallel_size=args.tensor_parallel_size, **extra)

    async def one(prompt, params) -> int:
        final = None
        async for out in group.generate({"prompt_token_ids": prompt}, params):
            final = out
        return len(final.outputs[0].token_ids)

    async def run_all(batch) -> int:
        counts = await asyncio.gather(*(one(p, SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                                                 max_tokens=n, ignore_eos=True)) for p, n in batch))
        return sum(counts)

    async def main() -> tuple[int, float]:
        await run_all([(p, 8) for p, _ in work[: 4 * args.data_parallel_size]])  # warm-up, every engine
        await group.reset_prefix_cache()
        start = time.perf_counter()
        num_out = await run_all(work)
        return num_out, time.perf_counter() - start

    try:
        num_out, elapsed = asyncio.run(main())
    finally:
        group.shutdown()
    assert num_out == sum(n for _, n in work), "every request runs to max_tokens"
    device = "cpu" if args.device == "cpu" or not torch.cuda.is_available() else "cuda"
    return {"elapsed_s": elapsed, "output_tokens": num_out, "output_tok_per_s": num_out / elapsed, "device": device,
            "dtype": str(_dtype(args, device)),
            "data_parallel_size": args.data_parallel_size, "tensor_parallel_size": args.tensor_parallel_size}


def run_hf(args, path: str, work, device: str, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos
    batch_size = args.hf_batch_size or args.max_num_seqs

    def generate(batch):
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(batch):  # left padding, as HF decoder-only generation wants
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        sample = dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=args.top_p) if args.temperature else dict(do_sample=False)
        with torch.no_grad():
            model.generate(ids.to(device), attention_mask=mask.to(device), pad_token_id=0,
                           max_new_tokens=max(n for _, n in batch), **sample)

    work = work[: args.hf_num_requests or len(work)]
    generate(work[:2])  # warm-up
    _sync(device)
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        generate(work[i : i + batch_size])
    _sync(device)
    elapsed = time.perf_counter() - start
    # Only the tokens each request asked for count; padding to the batch's longest is HF's cost.
    num_out = sum(n for _, n in work)
    return {"elapsed_s": elapsed, "output_tokens": num_out, "output_tok_per_s": num_out / elapsed,
            "batch_size": batch_size, "num_requests": len(work)}


def run_vllm(args, path: str, work, dtype: str) -> dict:
    """vLLM's LLM.generate on the same requests, in --vllm-python (benchmarks/vllm_peer.py)."""
    spec = {"model": path, "dtype": dtype, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.input_len[1] + args.output_len[1],
            "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
            "seed": args.seed, "temperature": args.temperature, "top_p": args.top_p, "requests": work}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_peer.py")
    with tempfile.TemporaryDirectory() as tmp:
        in_path, out_path = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(in_path, "w") as f:
            json.dump(spec, f)
        # vLLM's own environment: none of this repository on its path, its log output kept short.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        proc = subprocess.run([args.vllm_python, script, in_path, out_path], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the vLLM peer failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(out_path) as f:
            return json.load(f)


class BusyCore:
    """A competing process that keeps one core busy (a Python spin loop) while the block runs."""

    def __init__(self, cpu: int | None) -> None:
        self.cpu = cpu
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "BusyCore":
        code = "import os, sys\nif sys.argv[1] != 'any': os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"
        self.proc = subprocess.Popen([sys.executable, "-c", code, "any" if self.cpu is None else str(self.cpu)])
        time.sleep(0.5)  # running before the engine starts
        return self

    def __exit__(self, *exc) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


def _measured(fn, *fn_args) -> dict:
    before = load()
    result = fn(*fn_args)
    return {**result, "load_before": before, "load_after": load()}


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def run_vllm_comparison(args, path: str, work) -> None:
    """Ours and vLLM alternately (quiet, then with one busy core if asked); one table and one JSON."""
    if args.device not in ("auto", "cpu") or torch.cuda.is_available() and args.device == "auto":
        raise SystemExit("--peer vllm compares the CPU builds: pass --device cpu")
    dtype = str(_dtype(args, "cpu"))
    vllm_dtype = dtype.removeprefix("torch.")
    runs: dict[str, list[dict]] = {"ours": [], "vllm": []}
    if args.busy_core:
        runs.update({"ours_busy_core": [], "vllm_busy_core": []})
    for i in range(args.repeats):
        runs["ours"].append(_measured(run_engine, args, path, work))
        print(f"[{i}] ours: {runs['ours'][-1]['output_tok_per_s']:.1f} tok/s", flush=True)
        runs["vllm"].append(_measured(run_vllm, args, path, work, vllm_dtype))
        print(f"[{i}] vllm: {runs['vllm'][-1]['output_tok_per_s']:.1f} tok/s", flush=True)
        if args.busy_core:
            with BusyCore(args.busy_core_cpu):
                runs["ours_busy_core"].append(_measured(run_engine, args, path, work))
            print(f"[{i}] ours, one core busy: {runs['ours_busy_core'][-1]['output_tok_per_s']:.1f} tok/s", flush=True)
            with BusyCore(args.busy_core_cpu):
                runs["vllm_busy_core"].append(_measured(run_vllm, args, path, work, vllm_dtype))
            print(f"[{i}] vllm, one core busy: {runs['vllm_busy_core'][-1]['output_tok_per_s']:.1f} tok/s", flush=True)
    median = {name: _median([r["output_tok_per_s"] for r in rs]) for name, rs in runs.items()}
    ratios = {"ours_vs_vllm": median["ours"] / median["vllm"]}
    if args.busy_core:
        ratios["ours_busy_vs_quiet"] = median["ours_busy_core"] / median["ours"]
        ratios["vllm_busy_vs_quiet"] = median["vllm_busy_core"] / median["vllm"]
        ratios["ours_vs_vllm_busy_core"] = median["ours_busy_core"] / median["vllm_busy_core"]
    result = {
        "benchmark": "offline_throughput", "peer": "vllm", "frontend": args.frontend, "model": args.model,
        "model_path": path,
        "num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "temperature": args.temperature, "top_p": args.top_p, "dtype": dtype, "repeats": args.repeats,
        "busy_core_cpu": args.busy_core_cpu if args.busy_core else None,
        "machine": platform.node(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "vllm": runs["vllm"][0]["vllm"],
        "runs": runs, "median_output_tok_per_s": median, "ratios": ratios,
        "output_tok_per_s": median["ours"],
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "git_commit": _git_commit(),
    }
    print(f"\nOffline throughput: {args.num_requests} requests, prompt {args.input_len}, output {args.output_len}, "
          f"model {args.model}, cpu, {dtype}, ours through {args.frontend}, vLLM {result['vllm']}; "
          f"{args.repeats} run(s) each, alternating")
    print(f"{'engine':<22}{'output tok/s (each run)':>40}{'median':>10}{'load before (1/5/15 min)':>28}")
    for name, rs in runs.items():
        each = " ".join(f"{r['output_tok_per_s']:.0f}" for r in rs)
        loads = " | ".join("/".join(f"{x:.2f}" for x in r["load_before"]["loadavg"]) for r in rs)
        print(f"{name:<22}{each:>40}{median[name]:>10.0f}   {loads}")
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    write_json(args.json_out, result)


def _git_commit() -> str | None:
    """The checkout's HEAD (with "+dirty" when tracked files differ), so a result names the code it measured."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def _dtype(args, device: str) -> torch.dtype:
    from engine.worker.worker import resolve_dtype

    return resolve_dtype(args.dtype, torch.device(device))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    args = parse_args()
    if args.shape:
        from gpu_common import shape_checkpoint

        args.model = args.shape
        path = shape_checkpoint(args.shape)
    else:
        path = resolve_model(args.model)
    work = make_workload(args, vocab_size_of(path))
    if args.attention_order is not None:
        from engine.kernels import attention

        attention.LONGEST_FIRST = args.attention_order == "longest"
    if args.peer == "vllm":
        run_vllm_comparison(args, path, work)
        return
    if args.busy_core:
        with BusyCore(args.busy_core_cpu):
            ours = run_engine(args, path, work)
    else:
        ours = run_engine(args, path, work)
    result = {
        "benchmark": "offline_throughput",
        "model": args.model,
        "num_requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "kv_cache_dtype": args.kv_cache_dtype,
        "attention_order": args.attention_order,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "machine": platform.node(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "engine": ours,
        "output_tok_per_s": ours["output_tok_per_s"],
        "busy_core": args.busy_core,
        "load": load(),
    }
    if args.num_loras:  # the base run's load, before the adapters' run (which records its own)
        result["num_loras"], result["lora_rank"] = args.num_loras, args.lora_rank
    rows = [("ours", ours)]
    print(f"ours: {ours['output_tok_per_s']:.1f} output tok/s in {ours['elapsed_s']:.2f} s", flush=True)  # before HF's slow run
    if args.num_loras:
        with BusyCore(args.busy_core_cpu) if args.busy_core else contextlib.nullcontext():  # as the base run
            with_loras = _measured(run_with_loras, args, path, work)
        result["lora"] = with_loras
        result["lora_ratio_vs_base"] = with_loras["output_tok_per_s"] / ours["output_tok_per_s"]
        name = f"ours+{args.num_loras} LoRA r{args.lora_rank}"
        rows.append((name, with_loras))
        print(f"{name}: {with_loras['output_tok_per_s']:.1f} output tok/s in {with_loras['elapsed_s']:.2f} s "
              f"({result['lora_ratio_vs_base']:.3f} of the base model's)", flush=True)
    if args.peer == "hf":
        dtype = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16,
                 "torch.float16": torch.float16}[ours["dtype"]]
        hf = run_hf(args, path, work, ours["device"], dtype)
        result["hf"] = hf
        result["ratio_vs_hf"] = ours["output_tok_per_s"] / hf["output_tok_per_s"]
        rows.append(("hf generate()", hf))

    print(f"\nOffline throughput: {args.num_requests} requests, prompt {args.input_len}, output {args.output_len}, "
          f"model {args.model}, device {ours['device']}, {ours['dtype']}")
    print(f"{'engine':<24}{'output tokens':>15}{'time (s)':>12}{'output tok/s':>15}")
    for name, r in rows:
        print(f"{name:<24}{r['output_tokens']:>15}{r['elapsed_s']:>12.2f}{r['output_tok_per_s']:>15.1f}")
    if "lora_ratio_vs_base" in result:
        print(f"ratio with {args.num_loras} adapters / base model: {result['lora_ratio_vs_base']:.3f}")
    if "ratio_vs_hf" in result:
        print(f"ratio ours / HF: {result['ratio_vs_hf']:.2f}x")
    if "floor" in ours:
        f = ours["floor"]
        print(f"floor: {f['floor_s']:.2f} s over {f['num_steps']} steps ({f['floor_output_tok_per_s']:.0f} output tok/s; "
              f"bytes {f['bytes_s']:.2f} s at {f['copy_bandwidth_GBps']:.0f} GB/s, FLOPs {f['flops_s']:.2f} s at "
              f"{f['matmul_TFLOPs']:.0f} TFLOP/s): ours at {f['fraction_of_floor']:.2f} of the floor")
    write_json(args.json_out, result)


if __name__ == "__main__":
    main()

"""Shared pieces of the GPU benchmarks: model shapes with random weights, measured copy bandwidth, step timing."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

# Published shapes, random weights (never downloaded). Keys are the --shape choices.
SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3-0.6b": ("qwen3", dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "qwen2.5-1.5b": ("qwen2", dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "qwen2.5-7b": ("qwen2", dict(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6)),
}


def shape_config(shape: str, root: str = "/tmp/rollout-bench-config") -> str:
    """A checkpoint directory of `shape` without weights (config, tokenizer), for load_format="dummy"."""
    from engine.tiny_models import make_tiny_checkpoint

    arch, overrides = SHAPES[shape]
    path = Path(root) / shape
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, arch, dtype="bfloat16", **{**overrides, "num_hidden_layers": 1, "hidden_size": 64,
                                                               "intermediate_size": 64, "num_attention_heads": 4,
                                                               "num_key_value_heads": 2, "vocab_size": 1024})
        cfg = json.loads((path / "config.json").read_text())
        cfg.pop("layer_types", None)  # per-layer list sized for the 1-layer skeleton; rebuilt from num_hidden_layers
        cfg.pop("head_dim", None)
        cfg.update(overrides)
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        (path / "model.safetensors").unlink()  # the skeleton's weights do not fit the shape
    return str(path)


def shape_checkpoint(shape: str, root: str = "/tmp/rollout-bench") -> str:
    """Builds (once) a bf16 checkpoint of `shape` with random weights under `root` and returns its path.

    The 0.6B shape goes through make_tiny_checkpoint; the larger shapes write their random tensors
    from the GPU directly (a float32 CPU init of 7B parameters would take minutes).
    """
    from engine.tiny_models import make_tiny_checkpoint

    arch, overrides = SHAPES[shape]
    path = Path(root) / shape
    if (path / "model.safetensors").exists():
        return str(path)
    if shape == "qwen3-0.6b":
        return make_tiny_checkpoint(path, arch, dtype="bfloat16", **overrides)
    # Tokenizer and config files from a tiny checkpoint, then the full config and random weights.
    make_tiny_checkpoint(path, arch, dtype="bfloat16", **{**overrides, "num_hidden_layers": 1, "hidden_size": 64,
                                                           "intermediate_size": 64, "num_attention_heads": 4,
                                                           "num_key_value_heads": 2, "vocab_size": 1024})
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("layer_types", None)  # per-layer list sized for the 1-layer skeleton; rebuilt from num_hidden_layers
    cfg.update(overrides)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    _write_random_weights(path, cfg)
    return str(path)


@torch.no_grad()
def _write_random_weights(path: Path, cfg: dict) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator(device="cuda").manual_seed(0)
    state = {}
    for name, p in model.state_dict().items():
        if cfg.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        t = torch.empty(p.shape, dtype=torch.bfloat16, device="cuda")
        if "norm" in name and p.dim() == 1:
            t.normal_(1.0, 0.1, generator=gen)
        elif name.endswith("bias"):
            t.normal_(0.0, 0.1, generator=gen)
        elif "embed_tokens" in name:
            t.normal_(0.0, 1.0, generator=gen)
        else:
            scale = 2.0 if name.startswith("lm_head") else 1.0
            t.normal_(0.0, scale / math.sqrt(p.shape[-1]), generator=gen)
        state[name] = t.cpu()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def _median_device_seconds(fn, runs: int = 20, warmup: int = 5) -> float:
    """Median device time of fn() between CUDA events, over `runs` calls after `warmup` untimed ones."""
    times = []
    for i in range(warmup + runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return median(times)


def copy_bandwidth_bytes_per_s(num_bytes: int = 2 << 30) -> float:
    """Device copy bandwidth, counting bytes read plus written (median of 20 copies)."""
    src = torch.randn(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    seconds = _median_device_seconds(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / seconds


class StepTimer:
    """Records (num_reqs, num_tokens, runner seconds, engine-step seconds) of every EngineCore step.

    Wraps the LLM's EngineCore.step and the executor's way of running a step (launch_model with
    async scheduling, execute_model without). On CUDA the runner's time is the device time
    between events recorded before and after the step's work is queued (its forward pass and
    sampling), so it is the GPU's time for the step whether or not the host waits for it; on
    CPU it is the call's wall time. The engine-step time is one EngineCore.step() call: with
    async scheduling, launching step N+1 and collecting step N, i.e. the time per step.
    """

    def __init__(self, llm) -> None:
        self.records: list[tuple[int, int, object, float]] = []
        core = llm.engine_core
        self._cuda = torch.cuda.is_available()
        step = core.step
        pending: dict = {}

        def timed(run):
            def wrapper(sched):
                if self._cuda:
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                    out = run(sched)
                    end.record()
                    runner = (begin, end)
                else:
                    start = time.perf_counter()
                    out = run(sched)
                    runner = time.perf_counter() - start
                pending.update(n=len(sched.num_scheduled_tokens), t=sched.total_num_scheduled_tokens, r=runner)
                return out
            return wrapper

        def timed_step():
            pending.clear()
            start = time.perf_counter()
            out = step()
            elapsed = time.perf_counter() - start
            if pending:
                self.records.append((pending["n"], pending["t"], pending["r"], elapsed))
            return out

        if core.async_scheduling:
            core.executor.launch_model = timed(core.executor.launch_model)
        else:
            core.executor.execute_model = timed(core.executor.execute_model)
        core.step = timed_step

    def decode_steps(self, num_reqs: int) -> list[tuple[float, float]]:
        """(runner s, step s) of the steps where exactly num_reqs rows each decoded one token."""
        if self._cuda:
            torch.cuda.synchronize()
        out = []
        for n, t, r, s in self.records:
            if n == num_reqs and t == num_reqs:
                out.append((r[0].elapsed_time(r[1]) / 1e3 if isinstance(r, tuple) else r, s))
        return out


def matmul_flops_per_s(n: int = 8192) -> float:
    """Dense bf16 GEMM throughput on this device (median of 10 [n, n] @ [n, n] products)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    seconds = _median_device_seconds(lambda: a @ b, runs=10, warmup=3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / seconds


class StepFloor:
    """The floor of an engine run, step by step: each step's time is at least its bytes over the
    measured copy bandwidth and at least its FLOPs over the measured GEMM rate.

    Per step (from its SchedulerOutput): bytes = every weight once + the KV of each scheduled
    request's whole context (read by attention) + the KV it writes; FLOPs = 2 x layer weights x
    tokens + 2 x head weights x rows that sample + attention's 4 x query tokens x context x
    heads x head_dim per layer. The floor is the sum of max(bytes / bandwidth, FLOPs / rate)
    over the steps the engine actually ran, so it is the floor of this schedule (its step
    count), not of every possible schedule.
    """

    def __init__(self, llm, bandwidth: float, flops_per_s: float) -> None:
        worker = llm.engine_core.executor.worker
        model, hf = worker.model, worker.hf_config
        self.bandwidth, self.flops_per_s = bandwidth, flops_per_s
        self.weight_bytes = weight_bytes(model)
        self.layer_params = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
        self.head_params = hf.vocab_size * hf.hidden_size
        self.kv_per_token = worker.kv_bytes_per_block // llm.config.cache.block_size
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.attn_flops_per_pair = 4 * hf.num_attention_heads * head_dim * hf.num_hidden_layers
        self.num_prompt: dict[str, int] = {}
        self.steps: list[tuple[float, float]] = []  # (bytes s, FLOPs s)
        core = llm.engine_core
        name = "launch_model" if core.async_scheduling else "execute_model"
        run = getattr(core.executor, name)

        def recorded(sched):
            self.record(sched)
            return run(sched)

        setattr(core.executor, name, recorded)

    def record(self, sched) -> None:
        computed = {}
        for new in sched.scheduled_new_reqs:
            self.num_prompt[new.req_id] = new.num_prompt_tokens
            computed[new.req_id] = new.num_computed_tokens
        cached = sched.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        tokens = sched.total_num_scheduled_tokens
        if not tokens:
            return
        context = sampled = attn_pairs = 0
        for req_id, n in sched.num_scheduled_tokens.items():
            done = computed.get(req_id, 0) + n
            context += done
            attn_pairs += n * (done - (n - 1) / 2)  # query i of n attends to done - n + i + 1 keys
            sampled += done >= self.num_prompt.get(req_id, 0)
        moved = self.weight_bytes + (context + tokens) * self.kv_per_token
        flops = 2 * self.layer_params * tokens + 2 * self.head_params * sampled + self.attn_flops_per_pair * attn_pairs
        self.steps.append((moved / self.bandwidth, flops / self.flops_per_s))

    def summary(self, output_tokens: int, elapsed_s: float) -> dict:
        floor_s = sum(max(b, f) for b, f in self.steps)
        return {"floor_s": floor_s, "floor_output_tok_per_s": output_tokens / floor_s,
                "fraction_of_floor": floor_s / elapsed_s, "num_steps": len(self.steps),
                "bytes_s": sum(b for b, _ in self.steps), "flops_s": sum(f for _, f in self.steps),
                "copy_bandwidth_GBps": self.bandwidth / 1e9, "matmul_TFLOPs": self.flops_per_s / 1e12,
                "weight_bytes": self.weight_bytes, "kv_bytes_per_token": self.kv_per_token}


def timed(fn) -> float:
    """Wall seconds of fn() with the device synchronized before and after (what the caller waits for)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def device_busy(fn) -> dict:
    """fn() under torch.profiler (CUDA activity only): wall seconds, and the seconds the device was running
    anything (the union of its kernels' and copies' intervals, so kernels overlapping under programmatic
    dependent launch count once). The profiler slows the host a little, so busy_share is a lower bound."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy_us, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            busy_us += hi - max(lo, end)
            end = hi
    first_to_last = (spans[-1][1] - spans[0][0]) / 1e6 if spans else 0.0
    return {"wall_s": wall, "busy_s": busy_us / 1e6, "busy_share": busy_us / 1e6 / wall if wall else 0.0,
            "device_span_s": first_to_last, "num_device_events": len(spans)}


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


# Every projection LoRA can target in the Llama/Qwen families (fused q/k/v and gate/up in the engine).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_module_shapes(config: dict, targets: list[str]) -> dict[str, tuple[int, int]]:
    """{HF module name: (in_features, out_features)} of every targeted projection of a Llama/Qwen config."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    per_layer = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
                 "self_attn.o_proj": (q, hidden), "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
                 "mlp.down_proj": (inter, hidden)}
    unknown = sorted(set(targets) - {name.rpartition(".")[2] for name in per_layer})
    if unknown:
        raise ValueError(f"lora targets: {unknown} are not projections of this model ({', '.join(LORA_TARGETS)})")
    return {f"model.layers.{i}.{name}": shape for i in range(config["num_hidden_layers"])
            for name, shape in per_layer.items() if name.rpartition(".")[2] in targets}


@torch.no_grad()
def random_peft_adapter(base_path: str, out_dir: str, rank: int, targets: list[str] | None = None, *, seed: int = 0,
                        dtype: torch.dtype = torch.bfloat16, b_std: float = 0.02) -> str:
    """Writes a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) of `rank` on
    `targets` (default all projections) for the checkpoint or shape config at base_path; returns out_dir.

    Built from config.json alone (no base weights, no PEFT model: a 7B shape would need them in memory).
    A is PEFT-like (uniform, 1/sqrt(in_features)); B is random too, not PEFT's zeros, so the adapter really
    changes every projection's output (a zero B would be a no-op a kernel could skip)."""
    from safetensors.torch import save_file

    config = json.loads((Path(base_path) / "config.json").read_text())
    targets = list(targets or LORA_TARGETS)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (in_features, out_features) in lora_module_shapes(config, targets).items():
        bound = 1.0 / math.sqrt(in_features)
        a = torch.empty(rank, in_features).uniform_(-bound, bound, generator=gen)
        b = torch.randn(out_features, rank, generator=gen) * b_std
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(dtype)
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                      "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
                      "base_model_name_or_path": str(base_path)}
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return str(out)

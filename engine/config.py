"""Engine configuration: nested dataclasses, each field documented and validated once."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Literal, get_args

from engine.allowed_hosts import LOOPBACK_HOSTS, AllowedHosts
from engine.model_source import hub_repo_id, resolve_checkpoint, split_hub_name

LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LoadFormat = Literal["auto", "dummy"]
SchedulingPolicy = Literal["fcfs", "priority"]
# Who drives the engine (vLLM's UsageContext): an offline LLM, an HTTP server, or a plain AsyncLLM. On a GPU it picks
# the default token budget of a step (engine/core/scheduler.py default_max_num_batched_tokens).
UsageContext = Literal["llm_class", "api_server", "engine"]
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass
class ModelConfig:
    """What model to run and how to read its checkpoint."""

    model: str
    """An HF-format checkpoint directory (config.json, *.safetensors, tokenizer), or a hub name ORG/NAME[@revision] fetched into the Hugging Face cache (HF_HOME / HF_HUB_CACHE; HF_HUB_OFFLINE=1 reads the cache only). After validation this is the local directory; the name given stays `model_name`."""
    tokenizer: str | None = None
    """Tokenizer directory or hub name; defaults to `model`."""
    revision: str | None = None
    """The hub model's branch, tag or commit (as ORG/NAME@revision); default: the repository's main branch."""
    tokenizer_revision: str | None = None
    """The hub tokenizer's branch, tag or commit when `tokenizer` is a separate hub name; defaults to `revision`."""
    hf_token: str | None = None
    """Bearer token for private or gated hub models; default: HF_TOKEN or the token `hf auth login` stored. Used while resolving the model only, then cleared (never shown by /server_info)."""
    download_dir: str | None = None
    """Hugging Face cache directory to download hub models into and read them from; default: HF_HUB_CACHE (HF_HOME/hub)."""
    dtype: DTypeName = "auto"
    """Weight and activation dtype; `auto` is float32 on CPU and bfloat16 on GPU."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; defaults to the config's max_position_embeddings."""
    seed: int = 0
    """Seed of the engine's random generator (used by requests without their own seed)."""
    logprobs_mode: LogprobsMode = "raw_logprobs"
    """What returned logprobs mean: raw model output, or after penalties/temperature/top-k/top-p."""
    enforce_eager: bool = False
    """Never capture CUDA graphs: decode steps run eagerly too (GPU only; CPU is always eager)."""
    load_format: LoadFormat = "auto"
    """auto: read the checkpoint's *.safetensors; dummy: random weights of the config's shapes, nothing read (benchmarks, weight-sync targets)."""
    enable_sleep_mode: bool = False
    """CUDA, fixed addresses (CacheConfig.sleep_fixed_addresses): allocate sleep(1)'s pinned host copy of the weights at start-up (host memory the size of the weights, held for the engine's life), so the first sleep is as fast as every later one; off: the first sleep(1) allocates it (about 0.8 s for 0.6B, 7 s for 7B on an H200 host). sleep/wake_up work either way."""
    batch_invariant: bool = False
    """GPU: one fixed-tile GEMM for every linear layer and one attention tile shape for every row, so a token's logits do not depend on the other rows of its step (a request gives the same tokens alone, in any batch, and with or without speculative decoding, in bf16 too). Slower; engine/kernels/batch_invariant.py."""

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTypeName)
        _check_choice("logprobs_mode", self.logprobs_mode, LogprobsMode)
        _check_choice("load_format", self.load_format, LoadFormat)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        self._resolve_checkpoints()

    def _resolve_checkpoints(self) -> None:
        """Turns `model` and `tokenizer` into local directories, once, so the engine process, tokenizer, weight
        loader and reload_weights all read the same snapshot; `model_name` keeps the name to serve (vLLM's
        served model name: a hub name without its @revision)."""
        self.model_name = hub_repo_id(self.model)
        token, self.hf_token = self.hf_token, None
        parts = None if os.path.isdir(self.model) else split_hub_name(self.model)
        if parts is not None and parts[1] is not None and self.revision is None:
            self.revision = parts[1]
        if self.tokenizer_revision is None:
            self.tokenizer_revision = self.revision
        hub = {"download_dir": self.download_dir, "token": token}
        given_model, self.model = self.model, resolve_checkpoint(
            self.model, revision=self.revision, weights=self.load_format != "dummy", **hub)
        same_repo = self.tokenizer in (None, given_model)
        if same_repo and self.tokenizer_revision == self.revision:
            self.tokenizer = self.model
        else:  # a separate tokenizer, or the model's repository at another revision (as vLLM reads it)
            self.tokenizer = resolve_checkpoint(self.model_name if same_repo else self.tokenizer, field="tokenizer",
                                                revision=self.tokenizer_revision, weights=False, need_config=False, **hub)

    def hf_config_dict(self) -> dict:
        with open(os.path.join(self.model, "config.json")) as f:
            return json.load(f)


# kv_cache_dtype values and the cache element type they give (None: the model's dtype).
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


@dataclass
class CacheConfig:
    """Paged KV cache layout and size."""

    block_size: int = 16
    """Tokens per KV cache block."""
    enable_prefix_caching: bool = True
    """Reuse the KV of identical full prompt blocks across requests."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV blocks (overrides every memory-based sizing)."""
    kv_cache_memory_bytes: int | None = None
    """Bytes to give the KV cache (overrides gpu_memory_utilization and the CPU default)."""
    gpu_memory_utilization: float = 0.9
    """This engine's share of the GPU (per engine, as in vLLM: two engines at 0.4 fit one GPU): its weights and its KV cache, which gets the share less the weights and must fit in the memory free at start-up (an error names who holds the rest). Activations and CUDA graphs use memory beyond the share."""
    kv_cache_dtype: str = "auto"
    """The KV cache's element type: `auto` (the model's dtype) or `fp8` / `fp8_e4m3` (float8 e4m3, half the bytes of bf16: twice the blocks; keys and values are divided by their layer's per-tensor k_scale / v_scale, 1.0 unless set, and saturate at +-448)."""
    sleep_fixed_addresses: bool = True
    """CUDA: keep the weights and the KV cache at fixed device addresses (CUDA virtual memory management, engine/worker/device_memory.py), so that sleep gives their memory back and wake_up maps it again with every CUDA graph still valid; off (or without cuda-bindings): sleep frees through the caching allocator and wake_up captures the graphs again."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")


@dataclass
class SchedulerConfig:
    """How one step's token budget is handed out."""

    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step (prefill chunks and decodes together). Default as vLLM's: on a GPU of >= 70 GiB (not an A100) 16384 for LLM and rollout workers, 8192 for the server; on smaller GPUs 8192 / 2048; on CPU 2048; a plain AsyncLLM 2048. Without chunked prefill at least max_model_len."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    """`fcfs` (arrival order) or `priority` (lower value first, then arrival)."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps; off means a prompt must fit one step's budget."""
    async_scheduling: bool = True
    """Schedule and prepare step N+1 while the device runs step N (one step in flight; the host waits once per step). Engines whose executor runs in this process only; tensor-parallel executors and lockstep (expert-parallel) engines step synchronously, as do steps while a request uses penalties or bad words."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _check_choice("scheduling_policy", self.scheduling_policy, SchedulingPolicy)


@dataclass
class DeviceConfig:
    """Where the model runs."""

    device: str = "auto"
    """`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`."""

    def __post_init__(self) -> None:
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    def resolve(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class ParallelConfig:
    """How many worker processes one engine spans, and what starts them."""

    tensor_parallel_size: int = 1
    """Ranks that split every layer (attention heads, MLP columns, vocabulary); one worker per rank, rank r on device index base + r."""
    distributed_executor_backend: str | None = None
    """`uni` (one worker inside the engine process), `mp` (one process per rank), `ray` (Ray actors in a placement group, so an engine may span nodes); None: uni for one rank, mp for more."""

    ray_placement_strategy: str = "PACK"
    """The ray executor's placement group strategy: PACK (one node when it fits, else several), STRICT_PACK (one node only), SPREAD or STRICT_SPREAD."""

    # ---- data parallelism: set per engine by the group that starts it (rollout.group.RolloutGroup) ----
    data_parallel_size: int = 1
    """Engines in the data-parallel group this engine belongs to (1: a standalone engine)."""
    data_parallel_rank: int = 0
    """This engine's index in its data-parallel group."""
    enable_expert_parallel: bool = False
    """Shard MoE experts over the data-parallel group's engines (EP size = data_parallel_size); the engines then step in lockstep."""
    dp_sync_interval: int = 16
    """Lockstep engines all-reduce (has unfinished work, ready to pause) every this many steps, and on the first step of each wave."""
    data_parallel_master_ip: str = "127.0.0.1"
    """Rendezvous host of the group's process groups."""
    data_parallel_master_port: int = 0
    """Rendezvous base port: the engine cores' DP sync group (gloo) at this port, the workers' EP group at port + 1; 0: unset (the group picks free ports)."""
    data_parallel_join_later: bool = False
    """Elastic EP (set by RolloutGroup.prepare_elastic_ep for an engine added to a running group): start outside the DP sync and EP groups, holding every expert of the checkpoint, and join when the group's reconfigure call comes."""

    def __post_init__(self) -> None:
        if self.ray_placement_strategy not in ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"):
            raise ValueError(
                "ray_placement_strategy must be PACK, STRICT_PACK, SPREAD or STRICT_SPREAD, "
                f"got {self.ray_placement_strategy!r}"
            )
        if type(self.tensor_parallel_size) is not int \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {self.tensor_parallel_size!r}")
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend must be uni, mp or ray, got {self.distributed_executor_backend!r}"
            )
        for name in ("data_parallel_size", "dp_sync_interval"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if type(self.data_parallel_rank) is not int \
                or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank must be in [0, {self.data_parallel_size}), got {self.data_parallel_rank!r}"
            )
        if type(self.data_parallel_master_port) is not int \
                or not 0 <= self.data_parallel_master_port < 65535:
            raise ValueError(f"data_parallel_master_port must be a port number, got {self.data_parallel_master_port!r}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend=uni runs one worker; tensor_parallel_size > 1 needs mp or ray")

    @property
    def lockstep(self) -> bool:
        """Whether this engine steps in lockstep with the rest of its data-parallel group (expert parallelism)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def executor_backend(self) -> str:
        """The backend in effect (the None default resolved)."""
        return self.distributed_executor_backend or ("uni" if self.tensor_parallel_size == 1 else "mp")


@dataclass
class AdmissionConfig:
    """Frontend admission control: refuse (HTTP 503) rather than queue without bound."""

    max_num_queued_reqs: int | None = None
    """Most requests waiting in the engine before new ones are refused; None: no limit."""
    max_num_queued_tokens: int | None = None
    """Most prompt tokens waiting in the engine before new requests are refused; None: no limit."""

    def __post_init__(self) -> None:
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 0:
            raise ValueError(f"max_num_queued_reqs must be >= 0, got {self.max_num_queued_reqs}")
        if self.max_num_queued_tokens is not None and self.max_num_queued_tokens < 0:
            raise ValueError(f"max_num_queued_tokens must be >= 0, got {self.max_num_queued_tokens}")


@dataclass
class ObservabilityConfig:
    """Metrics and stats logging."""

    disable_log_stats: bool = False
    """Turn off the periodic stats log line."""
    log_stats_interval: float = 10.0
    """Seconds between two stats log lines."""
    stat_loggers: list[str] = field(default_factory=list)
    """Extra stat logger plugins by entry-point name (group `rollout_toolkit.stat_loggers`)."""

    def __post_init__(self) -> None:
        if self.log_stats_interval <= 0:
            raise ValueError(f"log_stats_interval must be > 0, got {self.log_stats_interval}")


@dataclass
class FaultToleranceConfig:
    """What the engine process does when a step raises: exit, or fail in-flight requests and wait for `retry`."""

    enable_fault_tolerance: bool = False
    """On an exception in a step: end in-flight requests with an error, mark the engine unhealthy and wait for a `retry` instruction instead of exiting."""
    engine_recovery_timeout_sec: float = 120.0
    """Seconds an unhealthy engine waits for a `retry` instruction before it exits (dead)."""
    enable_fault_injection: bool = False
    """Tests only: let the `inject_fault` utility make the engine's next step raise."""
    weight_update_rollback: str = "device"
    """Where a weight update keeps the weights it overwrites until it finishes, so a failed transfer restores them: device (fastest; transient memory up to the model's size), cpu, or none (a failed transfer leaves the engine refusing to serve until a new update finishes)."""

    weight_update_idle_timeout_s: float = 600.0
    """A weight update that gets no call (update or finish) for this many seconds is aborted - its trainer is presumed dead - and the previous weights serve again; 0 waits forever."""

    def __post_init__(self) -> None:
        if self.weight_update_idle_timeout_s < 0:
            raise ValueError(f"weight_update_idle_timeout_s must be >= 0, got {self.weight_update_idle_timeout_s}")
        if self.engine_recovery_timeout_sec <= 0:
            raise ValueError(f"engine_recovery_timeout_sec must be > 0, got {self.engine_recovery_timeout_sec}")
        if self.weight_update_rollback not in ("device", "cpu", "none"):
            raise ValueError(f"weight_update_rollback must be one of device, cpu, none; got {self.weight_update_rollback!r}")


@dataclass
class WeightTransferConfig:
    """Where the engine may connect for weight transfer (a trainer's init_info names the address)."""

    weight_transfer_allowed_hosts: list[str] = field(default_factory=lambda: list(LOOPBACK_HOSTS))
    """Hosts the engine may connect to for weight transfer (nccl, sparse_nccl: init_info master_address), checked before any connection: host names, IP addresses, CIDR networks (10.0.0.0/8) or * for any host. Default: loopback only."""
    weight_transfer_allow_pickled_ipc_handles: bool = False
    """Read vLLM's pickled CUDA IPC handles (ipc backend, update_info ipc_handles_pickled; vLLM's switch is VLLM_ALLOW_INSECURE_SERIALIZATION=1), through an allow-list that admits only rebuild_cuda_tensor's argument tuples (torch.Tensor/Parameter, torch.Size, the storage classes, dtypes, ints, bytes); off: such an update is refused (HTTP 400). Anyone who can reach the weight routes could then make the engine map CUDA memory of any process on its GPU."""

    def __post_init__(self) -> None:
        AllowedHosts.parse(self.weight_transfer_allowed_hosts)  # ValueError naming a bad entry
        self.weight_transfer_allowed_hosts = list(self.weight_transfer_allowed_hosts)


# The largest max_lora_rank accepted: a rank past it is no longer "low" and its slots would rival the weights.
MAX_LORA_RANK_LIMIT = 512


@dataclass
class LoRAConfig:
    """Multi-LoRA serving: PEFT adapters applied per request (LoRARequest) on top of the base weights."""

    enable_lora: bool = False
    """Serve LoRA adapters: each request may name one (lora_request); requests with different adapters, or none, share a batch."""
    max_loras: int = 1
    """Adapters resident at once (one slot each on the device); a step runs requests of at most this many adapters, the others wait."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted; every slot is sized for it (smaller ranks are zero-padded)."""
    max_cpu_loras: int | None = None
    """Adapters kept in host memory, to page into a slot without reading their files again (least recently used goes first); default max_loras."""

    def __post_init__(self) -> None:
        if type(self.max_loras) is not int or self.max_loras < 1:
            raise ValueError(f"max_loras must be a positive int, got {self.max_loras!r}")
        if type(self.max_lora_rank) is not int or not 1 <= self.max_lora_rank <= MAX_LORA_RANK_LIMIT:
            raise ValueError(f"max_lora_rank must be an int in [1, {MAX_LORA_RANK_LIMIT}], got {self.max_lora_rank!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if type(self.max_cpu_loras) is not int or self.max_cpu_loras < self.max_loras:
            # An adapter in a slot is paged in from its host copy, so every resident one has one.
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras!r}) must be an int >= max_loras ({self.max_loras})")


SpecMethod = Literal["ngram", "draft_model"]
_SPEC_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"},
    "draft_model": {"method", "num_speculative_tokens", "model", "attention_backend"},
}


@dataclass(frozen=True)
class SpecDecodeSettings:
    """A validated speculative_config: which speculator proposes how many tokens per step."""

    method: SpecMethod
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: shortest suffix looked up in the request's own tokens
    prompt_lookup_max: int = 3  # ngram: longest suffix looked up (tried first)
    model: str | None = None  # draft_model: checkpoint directory (same tokenizer as the target)
    attention_backend: str | None = None  # draft_model: engine.attention backend for its layers; None: the target's


def parse_speculative_config(raw: dict | None) -> SpecDecodeSettings | None:
    """The speculative_config dict (vLLM's keys) as settings, or ValueError naming the bad key or value."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"speculative_config must be a dict (JSON object), got {type(raw).__name__}")
    method = raw.get("method")
    if method not in _SPEC_KEYS:
        raise ValueError(f"speculative_config: method must be one of {sorted(_SPEC_KEYS)}, got {method!r}")
    unknown = sorted(set(raw) - _SPEC_KEYS[method])
    if unknown:
        raise ValueError(f"speculative_config: unknown keys for method {method!r}: {unknown}")
    k = raw.get("num_speculative_tokens")
    if type(k) is not int or not 1 <= k <= 16:
        raise ValueError(f"speculative_config: num_speculative_tokens must be an int in [1, 16], got {k!r}")
    settings = SpecDecodeSettings(method=method, num_speculative_tokens=k)
    if method == "ngram":
        lo, hi = raw.get("prompt_lookup_min", 1), raw.get("prompt_lookup_max", 3)
        if not all(type(v) is int for v in (lo, hi)) or not 1 <= lo <= hi:
            raise ValueError(
                f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max (ints), got {lo!r} and {hi!r}"
            )
        return dataclasses.replace(settings, prompt_lookup_min=lo, prompt_lookup_max=hi)
    model = raw.get("model")
    if not isinstance(model, str) or not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"speculative_config: model must be a checkpoint directory with a config.json, got {model!r}")
    backend = raw.get("attention_backend")
    if backend is not None:
        from engine.attention.layer import ATTENTION_BACKENDS

        if backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"speculative_config: attention_backend must be one of {sorted(ATTENTION_BACKENDS)}, got {backend!r}"
            )
    return dataclasses.replace(settings, model=model, attention_backend=backend)


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a speculator proposes tokens and the model verifies them in one step."""

    speculative_config: dict | None = None
    """Off when unset. As in vLLM: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3} or {"method": "draft_model", "model": DIR, "num_speculative_tokens": 4, "attention_backend": "triton"} (JSON on the command line). Outputs follow the model's distribution exactly; steps run without a step in flight."""

    def __post_init__(self) -> None:
        self.settings = parse_speculative_config(self.speculative_config)


@dataclass
class EngineConfig:
    """Everything one engine needs; built once and shared read-only by its parts."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    weight_transfer: WeightTransferConfig = field(default_factory=WeightTransferConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    usage_context: UsageContext = "engine"
    """Who drives the engine (create_engine_config's usage_context; not an engine argument)."""

    def __post_init__(self) -> None:
        _check_choice("usage_context", self.usage_context, UsageContext)


# The sections of EngineConfig, in --help order; their field names are unique across
# sections, so flat engine arguments (LLM(..., block_size=16)) map onto them one to one.
ENGINE_CONFIG_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "device": DeviceConfig,
    "parallel": ParallelConfig,
    "admission": AdmissionConfig,
    "observability": ObservabilityConfig,
    "fault_tolerance": FaultToleranceConfig,
    "speculative": SpeculativeConfig,
    "weight_transfer": WeightTransferConfig,
    "lora": LoRAConfig,
}


def _check_choice(name: str, value: object, literal: object) -> None:
    choices = get_args(literal)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")

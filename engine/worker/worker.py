"""Worker: owns the device, the model and the KV cache tensors, and runs steps through its ModelRunner."""

from __future__ import annotations

import logging
import os
import time

import torch

from engine.allowed_hosts import AllowedHosts
from engine.attention.layer import Attention
from engine.config import KV_CACHE_DTYPES, EngineConfig
from engine.core.sched_output import SchedulerOutput
from engine.core.scheduler import default_max_num_batched_tokens, token_budget
from engine.distributed.parallel_state import (
    destroy_expert_parallel,
    destroy_tensor_parallel,
    get_ep,
    init_expert_parallel,
    init_tensor_parallel,
)
from engine.executor.base import baseline_for_rank
from engine.kernels.batch_invariant import set_batch_invariant
from engine.kernels.sampling import gumbel_row_classes
from engine.lora.manager import LoRAManager
from engine.lora.request import LoRARequest
from engine.models.loader import load_hf_config, load_model
from engine.sample import Sampler, SamplingMetadata, make_generator
from engine.worker.memory import DeviceMemory, kv_cache_budget
from engine.worker.model_runner import ModelRunner, forward_without_kv_writes
from engine.worker.release import release_device_caches, release_module_tensors
from engine.worker.runner_output import ModelRunnerOutput
from engine.worker.sleep import allocate_kv_cache, pack_weights
from engine.worker.lora_weight_update import LoRAWeightUpdater
from engine.worker.weight_update import DRAFT_MODEL, TARGET_MODEL, WeightUpdater
from engine.worker.weight_updaters import WeightUpdaters

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# CPU default for the KV cache when no size is given: a few GiB at most.
_CPU_DEFAULT_KV_BYTES = 2 << 30


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def worker_device(device: str, rank: int, device_index: int | None = None) -> torch.device:
    """The device of tensor-parallel `rank`: CPU, or CUDA index base + rank (base: the index in
    "cuda:K", else the current device); device_index overrides it (a Ray actor sees one GPU as 0)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if device_index is not None:
        return torch.device("cuda", device_index)
    base = dev.index if dev.index is not None else torch.cuda.current_device()
    return torch.device("cuda", base + rank)


class Worker:
    """One tensor-parallel rank's share of the engine: its device, model shard and KV cache."""

    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        rank: int = 0,
        tp_size: int = 1,
        init_method: str | None = None,
        device_index: int | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.rank = rank
        self.tp_size = tp_size
        self.device = worker_device(config.device.resolve(), rank, device_index)
        self._shut_down = False
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # before NCCL: its communicator binds the current device
        # What this process had allocated on the device before the engine: determine_num_blocks counts the
        # difference as the engine's own (its weights). A caller's thread allocating meanwhile counts too.
        self._allocated_before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        # The group first: model layers read get_tp() while they are built, to size their shards.
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        init_tensor_parallel(tp_size, rank, init_method, backend=backend)
        # Expert parallelism: one worker per data-parallel engine, before the model (MoE layers read
        # get_ep() to pick their experts). A model without experts has nothing to shard: it simply
        # holds every weight, and its forward passes run no EP collective. MoE models run with
        # tensor_parallel_size 1 only, so an engine of several ranks (a dense model) joins no EP group.
        parallel = config.parallel
        # An engine added to a running group (elastic EP) joins later, by reconfigure_elastic_ep.
        if parallel.lockstep and tp_size == 1 and not parallel.data_parallel_join_later:
            if parallel.data_parallel_master_port == 0:
                raise ValueError("data_parallel_master_port: expert parallelism needs the data-parallel group's "
                                 "rendezvous port (0 is unset); the workers' EP group uses port + 1")
            init_expert_parallel(
                parallel.data_parallel_size, parallel.data_parallel_rank,
                f"tcp://{parallel.data_parallel_master_ip}:{parallel.data_parallel_master_port + 1}", backend=backend,
            )
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        set_batch_invariant(config.model.batch_invariant)  # process-wide, like the attention backend
        torch.manual_seed(config.model.seed)

        self.hf_config = load_hf_config(config.model.model)
        self.model = load_model(config.model.model, self.hf_config, self.dtype, self.device, config.model.load_format)
        # Sleep mode on CUDA keeps the weights, and then the KV cache, at fixed addresses (engine/worker/sleep.py),
        # so that sleep/wake_up keep the CUDA graphs: packed before anything records a weight's address.
        self.weight_region = pack_weights(self.model, self.device, config.cache.sleep_fixed_addresses)
        if config.model.enable_sleep_mode:
            self.sleeper.allocate_host_buffer()  # sleep(1)'s pinned copy, off the first sleep's path
        self.kv_region = None
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.model_runner = ModelRunner(
            config,
            self.model,
            self.device,
            architecture=self.hf_config.architectures[0],
            vocab_size=self.hf_config.vocab_size,
            max_model_len=max_model_len,
        )
        # LoRA serving: adapter slots on the model's linear layers, paged per step by the runner (the draft model has none).
        self.lora_manager = LoRAManager(self.model, config.lora, self.device, self.dtype) if config.lora.enable_lora else None
        self.model_runner.lora_manager = self.lora_manager
        # Built while the weights are resident: it records their shapes (sleep mode may empty them).
        self.allowed_hosts = AllowedHosts.parse(config.weight_transfer.weight_transfer_allowed_hosts)
        allow_pickled = config.weight_transfer.weight_transfer_allow_pickled_ipc_handles
        self.weight_updater = WeightUpdater(self.model, self.device, config.fault_tolerance.weight_update_rollback,
                                            allowed_hosts=self.allowed_hosts, allow_pickled_ipc_handles=allow_pickled)
        # The draft model's joins in _init_speculator; adapter syncs ride the target's transfer engine.
        loras = LoRAWeightUpdater(self.lora_manager, self.weight_updater) if self.lora_manager is not None else None
        self.weight_updaters = WeightUpdaters(self.weight_updater, loras=loras)
        self.draft_model: torch.nn.Module | None = None
        self.draft_proposer = None
        if config.speculative.settings is not None:
            self._init_speculator(config.speculative.settings)

    def _init_speculator(self, spec) -> None:
        """Gives the model runner its speculator; a draft model's attention layers join attn_layers, so
        its KV cache is sized, allocated, slept and woken with the model's (same block layout)."""
        runner = self.model_runner
        if spec.method == "ngram":
            from engine.worker.spec_decode.ngram.proposer import NgramProposer

            runner.set_speculator(NgramProposer(spec, runner.state), spec.num_speculative_tokens)
            return
        from engine.worker.spec_decode.draft_model.proposer import DraftModelProposer

        draft_config = load_hf_config(spec.model)
        self.draft_model = load_model(spec.model, draft_config, self.dtype, self.device, self.config.model.load_format)
        self.attn_layers += [m for m in self.draft_model.modules() if isinstance(m, Attention)]
        self.weight_updaters.draft = WeightUpdater(self.draft_model, self.device,
                                                   self.config.fault_tolerance.weight_update_rollback, DRAFT_MODEL,
                                                   allowed_hosts=self.allowed_hosts,
                                                   allow_pickled_ipc_handles=self.weight_updater.allow_pickled_ipc_handles)
        self.draft_proposer = DraftModelProposer(spec, self.draft_model, draft_config.architectures[0], self.device,
                                                 runner.state, self.config.cache.block_size)
        runner.set_speculator(self.draft_proposer, spec.num_speculative_tokens)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: the model's, or float8 e4m3 (CacheConfig.kv_cache_dtype)."""
        name = KV_CACHE_DTYPES[self.config.cache.kv_cache_dtype]
        return self.dtype if name is None else getattr(torch, name)

    @property
    def kv_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        per_token = sum(2 * layer.num_kv_heads * layer.head_size for layer in self.attn_layers)
        return per_token * self.config.cache.block_size * elem

    def default_token_budget(self) -> int:
        """The step budget when max_num_batched_tokens is unset: vLLM's default for this device and usage context."""
        if self.device.type != "cuda":
            return default_max_num_batched_tokens(self.config.usage_context, self.device.type)
        props = torch.cuda.get_device_properties(self.device)
        return default_max_num_batched_tokens(self.config.usage_context, "cuda", props.total_memory, props.name)

    def determine_num_blocks(self) -> int:
        """How many KV blocks this rank can hold; ValueError saying who holds the memory when none fits
        (engine/worker/memory.py has the rule)."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what loading left cached goes back first, so free is what the KV cache can take
            free, total = torch.cuda.mem_get_info(self.device)
            budget = kv_cache_budget(
                DeviceMemory(total, free, torch.cuda.memory_reserved(self.device) + self._region_bytes(), str(self.device)),
                engine_bytes=max(0, torch.cuda.memory_allocated(self.device) - self._allocated_before)
                + self._region_bytes(),
                utilization=cache.gpu_memory_utilization, block_bytes=self.kv_bytes_per_block,
                kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
            )
        elif cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        else:
            budget = min(_CPU_DEFAULT_KV_BYTES, _available_host_memory() // 2)
            # More blocks than every sequence at full length could use is wasted memory.
            blocks_per_seq = -(-self.max_model_len // cache.block_size)
            budget = min(budget, 2 * self.config.scheduler.max_num_seqs * blocks_per_seq * self.kv_bytes_per_block)
        num_blocks = budget // self.kv_bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv cache: {budget} bytes hold no block of {self.kv_bytes_per_block} bytes; "
                "raise kv_cache_memory_bytes or gpu_memory_utilization"
            )
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates one [2, num_blocks, block_size, kv_heads, head_size] tensor per layer.

        Zero-filled so that never-written slots hold finite values.
        """
        block_size = self.config.cache.block_size
        shapes = [((2, num_blocks, block_size, layer.num_kv_heads, layer.head_size), self.kv_cache_dtype)
                  for layer in self.attn_layers]
        kv_caches, self.kv_region = allocate_kv_cache(shapes, self.device, self.weight_region)
        for layer, kv_cache in zip(self.attn_layers, kv_caches, strict=True):
            layer.kv_cache = kv_cache
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks, block_size, num_blocks * self.kv_bytes_per_block / 2**20,
        )
        # Graphs record the KV tensors' addresses, so they are captured after allocation.
        self.capture_cuda_graphs()
        self._warm_up_kernels()

    def capture_cuda_graphs(self) -> None:
        """The model's graphs, and the draft model's when the model's were captured (both read the KV cache)."""
        runner = self.model_runner
        runner.capture_cuda_graphs()
        if self.draft_proposer is not None and runner.cuda_graphs is not None:
            self.draft_proposer.capture_cuda_graphs(self.config.scheduler.max_num_seqs, runner.max_num_blocks_per_req)

    def drop_cuda_graphs(self, wait: bool = True) -> None:
        """Releases both models' graphs and their memory pools (before the KV memory they point at is freed).

        wait: first wait for the device (a replay may still be queued); shutdown has waited already, or
        cannot (the device reports an error)."""
        if wait:
            self.synchronize()
        for owner in (self.model_runner, self.draft_proposer):
            graphs = getattr(owner, "cuda_graphs", None)
            if graphs is not None:
                graphs.release()
                owner.cuda_graphs = None

    # ---- kernel warm-up: every Triton variant compiles before serving, not during a timed step ----

    def _warm_up_kernels(self) -> None:
        """Compiles every Triton kernel variant before serving (GPU only) and logs how long it took.

        Triton compiles a kernel on its first call with each constexpr config (prefill or decode
        tiles, split-KV counts, MoE block sizes); the per-step ints are not specialized
        (do_not_specialize), so one pass per batch class compiles everything a real run uses.
        """
        if self.device.type != "cuda" or not self.attn_layers:
            return
        if get_ep().size > 1:
            # Each pass would run the MoE collectives of the expert-parallel group, and the other
            # engines need not be warming up at the same moment.
            logger.info("kernel warm-up skipped: expert parallelism")
            return
        start = time.perf_counter()
        num_passes = self.run_warm_up_passes()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the passes' activations go back; real steps allocate their own
        logger.info("kernel warm-up: %d forward passes in %.1f s", num_passes, time.perf_counter() - start)

    def run_warm_up_passes(self) -> int:
        """Eager forward passes of each batch class a real run can make, plus the sampler; returns the pass count.

        The passes read the KV cache but never write it (slot -1), and touch no request state
        and no engine generator. Runs on any device (the CPU tests call it directly).
        """
        sched = self.config.scheduler
        block_size = self.config.cache.block_size
        max_len = self.max_model_len
        budget = token_budget(sched, max_len, self.default_token_budget())
        max_num_seqs = sched.max_num_seqs
        decode_ctx = min(max_len, 2 * block_size + 1)  # a few blocks of context for decode rows
        # (query_lens, seq_lens) per batch; seq_len - query_len tokens of (zero or stale) context.
        batches: list[tuple[list[int], list[int]]] = []
        prompt = min(budget, max_len)
        batches.append(([prompt], [prompt]))  # prefill only: one whole prompt
        if max_num_seqs >= 3 and budget >= 4 and max_len >= 2:
            # Mixed, near the budget: a whole prompt, a chunk over a cached prefix, decode rows.
            num_decode = min(max_num_seqs - 2, budget // 4)
            chunk = (budget - num_decode) // 2
            first = min(budget - num_decode - chunk, max_len)
            chunk = min(chunk, max_len - 1)
            context = min(max_len - chunk, 2 * block_size + 3)
            batches.append(([first, chunk] + [1] * num_decode, [first, context + chunk] + [decode_ctx] * num_decode))
        runner = self.model_runner
        if runner.cuda_graphs is None or runner.supports_routed_experts:
            # Decode steps run eagerly too (no graphs; or MoE routing capture): their split-KV
            # count depends on the batch size, so sizes grow by about 1.5x, ending at max_num_seqs.
            size = 1
            while size < max_num_seqs:
                batches.append(([1] * size, [decode_ctx] * size))
                size = max(size + 1, size * 3 // 2)
            batches.append(([1] * max_num_seqs, [decode_ctx] * max_num_seqs))
        num_blocks = self.attn_layers[0].kv_cache.shape[1]
        logits = None
        draft = self.draft_proposer
        with torch.inference_mode():
            for query_lens, seq_lens in batches:
                hidden = forward_without_kv_writes(self.model, self.device, query_lens, seq_lens, num_blocks,
                                                   block_size)
                last = torch.tensor(query_lens, device=self.device).cumsum(0) - 1  # each row's last token
                logits = self.model.compute_logits(hidden[last])  # [rows, V]
                if draft is not None:  # the draft model's layers have their own shapes, so their own variants
                    with draft.backend():
                        forward_without_kv_writes(self.draft_model, self.device, query_lens, seq_lens, num_blocks,
                                                  block_size)
            self.model.compute_logits(hidden[-1:])  # one row (a single finishing prefill)
            # The sampling kernel compiles one variant per chunk length, which depends on the row count
            # (a speculative step samples at each row's last token and each of its drafts).
            max_sample_rows = max_num_seqs * (self.model_runner.num_spec_tokens + 1)
            for num_rows in gumbel_row_classes(logits.shape[1], max_sample_rows):
                rows = logits[torch.arange(num_rows, device=self.device) % logits.shape[0]]
                self._warm_up_sampler(rows, shaped=True)
                self._warm_up_sampler(rows, shaped=False)
        return len(batches)

    def _warm_up_sampler(self, logits: torch.Tensor, shaped: bool) -> None:
        """One sampler call: greedy and random rows, with top-k/top-p, a seeded row and logprobs (shaped)
        or temperature alone (the fast path).

        Its own Sampler and generator, so the engine's seeded stream is not advanced.
        """
        num_rows = logits.shape[0]
        dev = self.device
        temperature = torch.tensor([0.0 if i % 2 else 1.0 for i in range(num_rows)], device=dev)
        metadata = SamplingMetadata(
            temperature=temperature,
            all_greedy=False,
            all_random=num_rows == 1,
            top_k=torch.full((num_rows,), min(20, logits.shape[1]), dtype=torch.int64, device=dev) if shaped else None,
            top_p=torch.full((num_rows,), 0.9, device=dev) if shaped else None,
            min_p=None,
            generators={0: make_generator(0, 0, dev)} if shaped else {},
            presence_penalties=None,
            frequency_penalties=None,
            repetition_penalties=None,
            prompt_token_ids=None,
            output_token_ids=[],
            max_num_logprobs=1 if shaped else None,
        )
        Sampler(torch.Generator(device=dev))(logits, metadata)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def execute_dummy_batch(self) -> None:
        """One forward pass of one dummy token (no request state, no KV write): keeps this rank's
        expert-parallel collectives in step with engines that have work."""
        self.model_runner.execute_dummy_batch()

    def reconfigure_elastic_ep(self, plan: dict) -> None:
        """Elastic EP: moves experts and rebuilds the expert-parallel group for a new group size (engine/worker/elastic_ep.py)."""
        from engine.worker.elastic_ep import reconfigure_worker

        reconfigure_worker(self, plan)

    def reset_requests(self) -> None:
        """Drops every request's state (after a failed step); weights and KV tensors stay."""
        self.model_runner.reset_requests()

    # ---- LoRA adapters (engine/lora/manager.py); the EngineCore checks enable_lora first ----

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Reads and validates the adapter into this rank's host cache; ValueError naming the problem."""
        self._lora().add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        manager = self._lora()
        self.weight_updaters.loras.discard(lora_id)  # a sync of it in progress goes with it
        return manager.remove_lora(lora_id)

    def pin_lora(self, lora_request: LoRARequest) -> bool:
        return self._lora().pin_lora(lora_request)

    def _lora(self) -> LoRAManager:
        if self.lora_manager is None:
            raise ValueError("LoRA is off: start the engine with enable_lora=True (--enable-lora)")
        return self.lora_manager

    # ---- weight updates: engine/worker/weight_update.py owns the state machine and validation ----
    # init_info / update_info "model" (and weight_info / weight_checker's model) pick the target
    # model (the default) or the draft model (WeightUpdaters).

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Blocking: for callers of this Worker itself. The engine core uses the four calls below."""
        self.weight_updaters.init_transfer_engine(init_info)

    # init without blocking (engine/worker/transfer_init.py): begin validates and starts the rendezvous
    # in the background; poll says when it is ready (or raises); commit installs; cancel drops.
    def begin_weight_transfer_init(self, init_info: dict) -> None:
        self.weight_updaters.begin_init(init_info)

    def poll_weight_transfer_init(self) -> bool:
        return self.weight_updaters.poll_init()

    def commit_weight_transfer_init(self) -> None:
        self.weight_updaters.commit_init()

    def cancel_weight_transfer_init(self) -> None:
        self.weight_updaters.cancel_init()

    def start_weight_update(self) -> None:
        self.weight_updaters.start_update()

    def update_weights(self, update_info: dict | list[dict]) -> int:
        """update_info, or this rank's entry of vLLM's per-worker list (data_parallel_rank * tp + rank)."""
        return self.weight_updaters.update_weights(self._own_update_info(update_info))

    def update_lora_weights(self, update_info: dict | list[dict], lora_request: LoRARequest) -> int:
        """update_weights for adapter tensors (engine/worker/lora_weight_update.py): staged for `lora_request`'s
        adapter until finish_weight_update; update_info without its "lora_name" (the EngineCore resolved it)."""
        return self.weight_updaters.update_lora(self._own_update_info(update_info), lora_request)

    def _own_update_info(self, update_info: dict | list[dict]) -> dict:
        if isinstance(update_info, list):
            index = self.config.parallel.data_parallel_rank * self.config.parallel.tensor_parallel_size + self.rank
            if index >= len(update_info):
                raise ValueError(f"update_info: the list has {len(update_info)} entries; worker {index} has none")
            update_info = update_info[index]
        return update_info

    def finish_weight_update(self) -> None:
        self.weight_updaters.finish_update()

    def abort_weight_update(self) -> bool:
        return self.weight_updaters.abort_update()

    def shutdown_weight_transfer_engine(self) -> None:
        self.weight_updaters.shutdown()

    def weight_info(self, model: str = TARGET_MODEL) -> dict:
        return self.weight_updaters.select(model).weight_info()

    def weight_checker(self, baseline: dict | None = None, model: str = TARGET_MODEL) -> dict:
        """This rank's checksums of `model`; a {"ranks": [...]} baseline is read at this rank's entry. The target's
        include every adapter held in host memory ("lora:<lora_name>:<PEFT tensor name>"), which a baseline may
        leave out (one that lists them compares them)."""
        adapters = self.lora_manager.checksums() if self.lora_manager is not None and model == TARGET_MODEL else None
        return self.weight_updaters.select(model).weight_checker(baseline_for_rank(baseline, self.rank), adapters)

    def compute_weight_checksums(self) -> dict[str, str]:
        """vLLM's per-worker digests of the served model (weight_transfer.checksums.engine_weight_digests)."""
        from weight_transfer.checksums import engine_weight_digests, worker_checksum_prefix

        prefix = worker_checksum_prefix(self.config.parallel.data_parallel_rank, self.rank)
        return engine_weight_digests(self.model, prefix)

    def reset_weights(self) -> None:
        """Zeroes every weight of the served model (vLLM's weight checker "reset": a test that an update lands)."""
        with torch.no_grad():
            for param in self.model.parameters():
                param.zero_()

    def weights_consistent(self) -> bool:
        """False while a failed transfer that could not roll back leaves the weights a mix."""
        return self.weight_updaters.consistent

    def num_parameters(self) -> int:
        """Parameter elements this rank holds (a tensor-parallel shard holds about 1/tp_size of most; an
        expert-parallel rank only its experts)."""
        return sum(p.numel() for p in self.model.parameters())

    def cpu_threads(self) -> dict:
        """This rank's torch thread count and the cores its process may run on (on CPU, as
        engine/executor/cpu_threads.py chose them)."""
        from engine.executor.cpu_threads import allowed_cpus

        return {"num_threads": torch.get_num_threads(), "cpus": allowed_cpus(), "pid": os.getpid()}

    # ---- sleep / wake-up: engine/worker/sleep.py frees and restores the memory ----

    @property
    def sleeper(self):
        sleeper = self.__dict__.get("_sleeper")
        if sleeper is None:
            from engine.worker.sleep import WorkerSleeper

            sleeper = self._sleeper = WorkerSleeper(self)
        return sleeper

    def sleep(self, level: int) -> None:
        self.sleeper.sleep(level)

    def release_kv_cache(self) -> None:
        """The KV cache's memory goes, the weights stay (EngineCore.release_kv_cache_memory)."""
        self.sleeper.release_kv_cache()

    def _region_bytes(self) -> int:
        """Device memory in the fixed-address regions (the caching allocator does not count it)."""
        return sum(r.size for r in (self.weight_region, self.kv_region) if r is not None)

    def close_regions(self) -> None:
        """Gives the fixed-address regions back; only once no tensor the worker uses points into them."""
        for name in ("weight_region", "kv_region"):
            region = getattr(self, name)
            if region is not None:
                region.close()
                setattr(self, name, None)

    def wake_up(self, tags: list[str], reload_weights: bool = False) -> None:
        self.sleeper.wake_up(tags, reload_weights)

    def unwritten_weights(self) -> list[str]:
        """The served model's weights sleep(2) discarded that no finished update has written since (sorted)."""
        return sorted(self.weight_updaters.target.unwritten)

    def synchronize(self) -> None:
        """Waits for every queued device operation (a no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shutdown(self) -> None:
        """Shuts the transfer engines down, leaves the tensor- and expert-parallel groups and gives back every
        tensor the worker holds on its device before it returns; idempotent. The worker serves nothing afterwards.

        Explicitly, not by dropping references: the caller may still hold the engine (a variable after its
        `with` block), and the weights, the KV cache and the graphs must be free for the next engine then.
        """
        if self._shut_down:
            return
        self._shut_down = True
        try:
            self.weight_updaters.release()  # a rendezvous still running: what it builds is shut down
            destroy_expert_parallel()
            destroy_tensor_parallel()
        finally:
            self._release_memory()

    def _release_memory(self) -> None:
        """Weights, KV cache, CUDA graphs and their pool, the draft model, the step in flight, the host copies of
        sleeping weights; then the allocator's cache and cuBLAS's workspaces go back to the device."""
        try:
            self.synchronize()  # nothing queued may still read what is freed below
            device_ok = True
        except RuntimeError as e:  # a device error (a failed kernel) is sticky: the tensors are dropped all the same
            logger.warning("Worker shutdown: the device reports %s; releasing its tensors without waiting for it", e)
            device_ok = False
        self.drop_cuda_graphs(wait=False)
        self.model_runner.release()
        sleeper = self.__dict__.pop("_sleeper", None)
        if sleeper is not None:
            sleeper.release()
        for layer in self.attn_layers:
            layer.kv_cache = None
        for model in (self.model, self.draft_model):
            if model is not None:
                release_module_tensors(model)
        if device_ok:  # unmapping memory a failed kernel may still be queued on would fault again
            self.close_regions()
        if device_ok:  # the allocator's calls would raise the device's error again
            release_device_caches(self.device)

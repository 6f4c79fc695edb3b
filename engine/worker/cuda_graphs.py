"""Decode CUDA graphs, owned by the model runner: one graph per batch-size bucket, all in one memory pool.

Models and attention never know graphs exist: a graph is a recording of the ordinary
forward pass over static input buffers. A decode step (every row one token) with at most
the largest bucket's rows copies its inputs into those buffers and replays the smallest
bucket that fits; rows past the real ones are padding (seq_len 0: attention gives zeros;
slot -1: no KV write) and their outputs are dropped. Anything else runs eagerly.

With speculative decoding (max_verify_len = k + 1 > 1) a second graph per bucket serves
verify steps: every row has 1..max_verify_len tokens (its last known token and its drafts).
Such a graph runs bucket * max_verify_len token slots; the rows' tokens are packed at the
front, padding rows have no tokens, and the slots past the real tokens belong to no row
(attention gives them zeros; slot -1: no KV write).

With LoRA on, every graph reads two more static inputs, each token slot's adapter slot (-1: none,
as for every padding slot) and the token slots grouped by it (the order the LoRA kernels walk
them in), written before each replay; the graphs always run the LoRA kernels,
which read whatever adapters are in the slots at replay time (engine/lora/layers.py).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.forward_context import set_forward_context
from engine.lora.ops import LoRAMapping
from engine.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to 256, every 32 beyond; capped at max_num_seqs."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(288, max_num_seqs + 32, 32))
    out = sorted({min(s, max_num_seqs) for s in sizes})
    return out


class CudaGraphRunner:
    """Captures and replays decode forward passes; the caller checks `bucket_for` first."""

    def __init__(self, model: torch.nn.Module, device: torch.device, max_num_seqs: int,
                 max_num_blocks_per_req: int, max_verify_len: int = 1, lora: bool = False) -> None:
        self.model = model
        self.device = device
        self.buckets = graph_buckets(max_num_seqs)
        self.max_verify_len = max_verify_len
        n = self.buckets[-1]
        t = n * max_verify_len  # token slots
        # Static device inputs, read by every graph (graphs for smaller buckets use a prefix).
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)  # [t]
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)  # [t]
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)  # [t]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)  # [n]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [n + 1], one token per row
        # Verify graphs' row starts, written every replay (decode graphs keep the one above fixed).
        self.verify_query_start_loc = torch.zeros(n + 1, dtype=torch.int32, device=device)  # [n + 1]
        self.block_table = torch.zeros(n, max_num_blocks_per_req, dtype=torch.int32, device=device)
        # LoRA (lora=True): each token slot's adapter slot, -1 for none; None without LoRA.
        self.lora_slots = torch.full((t,), -1, dtype=torch.int32, device=device) if lora else None  # [t]
        # ... and the token slots grouped by adapter slot (LoRAMapping.token_order), padding last in place.
        self.lora_order = torch.arange(t, dtype=torch.int32, device=device) if lora else None  # [t]
        static = [("input_ids", self.input_ids), ("positions", self.positions), ("slot_mapping", self.slot_mapping),
                  ("seq_lens", self.seq_lens), ("block_table", self.block_table),
                  ("verify_query_start_loc", self.verify_query_start_loc)]
        if lora:
            static += [("lora_slots", self.lora_slots), ("lora_order", self.lora_order)]
        # Pinned host mirrors, one async copy each per step. Two sets, used in turn: with a step
        # in flight (async scheduling) the previous replay's copies may not have run yet when the
        # next step's inputs are written; the step before that has finished (the engine collects
        # it before launching the next).
        self._host = [{name: torch.zeros_like(t, device="cpu").pin_memory() for name, t in static} for _ in range(2)]
        self._host_np = [{name: t.numpy() for name, t in host.items()} for host in self._host]
        self._turn = 0
        # Keyed by (bucket, tokens per row): (size, 1) decode graphs, (size, max_verify_len) verify graphs.
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # [size * q, hidden], written by each replay
        self.pool = None
        self.num_replays = 0  # steps served by a graph (for benchmarks and tests)
        self.num_verify_replays = 0  # of which verify steps

    def _metadata(self, size: int, q: int) -> AttentionMetadata:
        return AttentionMetadata(
            # Verify graphs: 0, i.e. any token slot may be padding, so attention zero-fills its output.
            num_actual_tokens=size if q == 1 else 0,
            query_start_loc=(self.query_start_loc if q == 1 else self.verify_query_start_loc)[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[: size * q],
            max_query_len=q,
            max_seq_len=0,  # not read by graph-capable backends
            query_lens_cpu=[q] * size,
            seq_lens_cpu=[0] * size,
        )

    def _lora_mapping(self, size: int, q: int) -> LoRAMapping | None:
        """The graphs' LoRA mapping: the static slots only (no segments: on GPU the layers read token_slots)."""
        if self.lora_slots is None:
            return None
        return LoRAMapping(size * q, (), self.lora_slots[: size * q], self.lora_order[: size * q])

    def _forward(self, size: int, q: int) -> torch.Tensor:
        with set_forward_context(self._metadata(size, q), self._lora_mapping(size, q)):
            return self.model(self.input_ids[: size * q], self.positions[: size * q])

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        # Largest first, so smaller graphs reuse the pool's blocks.
        keys = [(size, q) for size in reversed(self.buckets) for q in sorted({self.max_verify_len, 1}, reverse=True)]
        for key in keys:
            size, q = key
            if q > 1:  # capture-time rows: q tokens each, no keys beyond their own
                self.verify_query_start_loc[: size + 1] = torch.arange(size + 1, device=self.device) * q
            self.seq_lens.fill_(q if q > 1 else 0)
            self._forward(size, q)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[key] = self._forward(size, q)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[key] = graph
        self.seq_lens.zero_()
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured %d CUDA graphs (batch %d..%d, tokens per row %s) in %.1f s, %.0f MiB",
                    len(self.graphs), self.buckets[0], self.buckets[-1], sorted({1, self.max_verify_len}),
                    time.perf_counter() - start, used / 2**20)

    def release(self) -> None:
        """Gives back the graphs, their memory pool and the static buffers (sleep, elastic EP, shutdown);
        the runner replays nothing afterwards. The caller synchronizes first: a replay may still be queued.

        Dropping the last reference would free them too, but only once nothing else holds the runner
        (a benchmark reading num_replays, a frame of a failed step): reset() frees each graph now, and
        its pool's blocks go back to the allocator once the outputs that live in it are gone.
        """
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "verify_query_start_loc",
                     "block_table", "lora_slots", "lora_order"):
            setattr(self, name, None)
        self._host, self._host_np = [], []  # pinned host memory

    def bucket_for(self, batch: InputBatch) -> tuple[int, int] | None:
        """The graph to replay for this step, or None to run eagerly (a longer row, or too big)."""
        num_reqs = batch.num_reqs
        if num_reqs == 0 or num_reqs > self.buckets[-1]:
            return None
        if batch.num_tokens == num_reqs:
            q = 1
        elif self.max_verify_len > 1 and int(batch.num_scheduled_tokens.max()) <= self.max_verify_len:
            q = self.max_verify_len
        else:
            return None
        if batch.block_table.shape[1] > self.block_table.shape[1]:
            return None
        return self.buckets[int(np.searchsorted(self.buckets, num_reqs))], q

    def replay(self, key: tuple[int, int], batch: InputBatch,
               fill: tuple[torch.Tensor | slice, torch.Tensor] | None = None,
               lora_slots: np.ndarray | None = None) -> torch.Tensor:  # [num_tokens, hidden]
        """fill: (token indices or a slice of them, ids) written into the input ids on the device before the replay;
        lora_slots: [num_tokens] each token's adapter slot (-1: none; None: no token has an adapter),
        for graphs captured with LoRA."""
        size, q = key
        n, num_tokens, slots = batch.num_reqs, batch.num_tokens, size * q
        self._turn ^= 1
        host = self._host[self._turn]
        h = self._host_np[self._turn]
        h["input_ids"][:num_tokens] = batch.input_ids
        h["positions"][:num_tokens] = batch.positions
        h["slot_mapping"][:num_tokens] = batch.slot_mapping
        h["seq_lens"][:n] = batch.seq_lens
        h["block_table"][:n, : batch.block_table.shape[1]] = batch.block_table
        # Padding rows and token slots: no KV write, no keys, position 0.
        h["input_ids"][num_tokens:slots] = 0
        h["positions"][num_tokens:slots] = 0
        h["slot_mapping"][num_tokens:slots] = -1
        h["seq_lens"][n:size] = 0
        names = ["input_ids", "positions", "slot_mapping"]
        if self.lora_slots is not None:
            h["lora_slots"][:num_tokens] = -1 if lora_slots is None else lora_slots
            h["lora_slots"][num_tokens:slots] = -1  # padding: no adapter
            order = h["lora_order"]
            order[:num_tokens] = np.arange(num_tokens) if lora_slots is None else np.argsort(lora_slots, kind="stable")
            order[num_tokens:slots] = np.arange(num_tokens, slots)
            names += ["lora_slots", "lora_order"]
        else:
            assert lora_slots is None, "adapter slots for graphs captured without LoRA"
        for name in names:
            getattr(self, name)[:slots].copy_(host[name][:slots], non_blocking=True)
        names = ["seq_lens", "block_table"]
        if q > 1:
            h["verify_query_start_loc"][: n + 1] = batch.query_start_loc
            h["verify_query_start_loc"][n + 1 : size + 1] = num_tokens  # padding rows own no tokens
            self.verify_query_start_loc[: size + 1].copy_(host["verify_query_start_loc"][: size + 1], non_blocking=True)
            self.num_verify_replays += 1
        for name in names:
            getattr(self, name)[:size].copy_(host[name][:size], non_blocking=True)
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        self.graphs[key].replay()
        self.num_replays += 1
        return self.outputs[key][:num_tokens]

"""Decode CUDA graphs, owned by the model runner: one graph per batch-size bucket, all in one memory pool.

Models and attention never know graphs exist: a graph is a recording of the ordinary
forward pass over static input buffers. A decode step (every row one token) with at most
the largest bucket's rows copies its inputs into those buffers and replays the smallest
bucket that fits; rows past the real ones are padding (seq_len 0: attention gives zeros;
slot -1: no KV write) and their outputs are dropped. Anything else runs eagerly.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.forward_context import set_forward_context
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
                 max_num_blocks_per_req: int) -> None:
        self.model = model
        self.device = device
        self.buckets = graph_buckets(max_num_seqs)
        n = self.buckets[-1]
        # Static device inputs, read by every graph (graphs for smaller buckets use a prefix).
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [n]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [n]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)  # [n]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)  # [n]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [n + 1], one token per row
        self.block_table = torch.zeros(n, max_num_blocks_per_req, dtype=torch.int32, device=device)
        # Pinned host mirrors, one async copy each per step. Two sets, used in turn: with a step
        # in flight (async scheduling) the previous replay's copies may not have run yet when the
        # next step's inputs are written; the step before that has finished (the engine collects
        # it before launching the next).
        self._host = [
            {
                name: torch.zeros_like(t, device="cpu").pin_memory()
                for name, t in (("input_ids", self.input_ids), ("positions", self.positions),
                                ("slot_mapping", self.slot_mapping), ("seq_lens", self.seq_lens),
                                ("block_table", self.block_table))
            }
            for _ in range(2)
        ]
        self._host_np = [{name: t.numpy() for name, t in host.items()} for host in self._host]
        self._turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [bucket, hidden], written by each replay
        self.pool = None
        self.num_replays = 0  # decode steps served by a graph (for benchmarks and tests)

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=0,  # not read by graph-capable backends
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[0] * size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        with set_forward_context(self._metadata(size)):
            return self.model(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        # Largest first, so smaller graphs reuse the pool's blocks.
        for size in reversed(self.buckets):
            self._forward(size)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self._forward(size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s, %.0f MiB",
                    len(self.graphs), self.buckets[0], self.buckets[-1], time.perf_counter() - start, used / 2**20)

    def bucket_for(self, batch: InputBatch) -> int | None:
        """The bucket to replay for this step, or None to run eagerly (not all-decode, or too big)."""
        num_reqs = batch.num_reqs
        if num_reqs == 0 or num_reqs > self.buckets[-1] or batch.num_tokens != num_reqs:
            return None
        if batch.block_table.shape[1] > self.block_table.shape[1]:
            return None
        return self.buckets[int(np.searchsorted(self.buckets, num_reqs))]

    def replay(self, size: int, batch: InputBatch,
               fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # [num_reqs, hidden]
        """fill: (token indices, ids) written into the input ids on the device before the replay."""
        n = batch.num_reqs
        self._turn ^= 1
        host = self._host[self._turn]
        h = self._host_np[self._turn]
        h["input_ids"][:n] = batch.input_ids
        h["positions"][:n] = batch.positions
        h["slot_mapping"][:n] = batch.slot_mapping
        h["seq_lens"][:n] = batch.seq_lens
        h["block_table"][:n, : batch.block_table.shape[1]] = batch.block_table
        # Padding rows: no KV write, no keys, position 0.
        h["input_ids"][n:size] = 0
        h["positions"][n:size] = 0
        h["slot_mapping"][n:size] = -1
        h["seq_lens"][n:size] = 0
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_table"):
            getattr(self, name)[:size].copy_(host[name][:size], non_blocking=True)
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:n]

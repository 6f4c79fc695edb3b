"""Paged attention for CPU tensors: a small C kernel (cpu_attention.c) that reads the paged KV cache in place.

The reference is engine.attention.torch_ref, whose decode path copies each row's whole context
out of the cache (index_select) before SDPA reads it again: on CPU that gather and the padding
of a decode batch were most of a step. The C kernel attends over the block table directly, one
(row, KV head) at a time, for decode rows and short multi-token rows (speculative verification,
RL prompts of a few tokens); longer rows (prefill chunks) stay on torch_ref's SDPA batches, where
a GEMM-shaped kernel wins. The kernel is compiled once per source and CPU with the machine's C
compiler into the user cache; with no compiler, an fp8 cache, or a dtype other than float32 or
bfloat16, every call runs torch_ref.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from engine.attention import torch_ref
from engine.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

write_kv_cache = torch_ref.write_kv_cache

# Rows with at most this many query tokens run in the C kernel (it recomputes each query's
# scores over the context, O(query_len * seq_len) scalar dot products); longer rows go to SDPA.
MAX_KERNEL_QUERY_LEN = 16

_SOURCE = Path(__file__).with_name("cpu_attention.c")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # enum in cpu_attention.c
# -fno-trapping-math: the clamp in exp_nonpositive may become a vector max (no FP exceptions are used).
_COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-trapping-math", "-fPIC", "-shared", "-pthread",
                  "-std=gnu11"]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rollout-toolkit" / "kernels"


def _cpu_signature() -> str:
    """What a -march=native build depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use into the user cache; None when it cannot be built."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None or not _SOURCE.exists():
        logger.info("CPU attention: no C compiler found; using the torch reference")
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_COMPILE_FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_attention-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent processes never load a half-written file.
        fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        result = subprocess.run([compiler, *_COMPILE_FLAGS, str(_SOURCE), "-o", partial, "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(partial)
            logger.warning("CPU attention: compiling %s failed; using the torch reference:\n%s", _SOURCE,
                           result.stderr[-2000:])
            return None
        os.replace(partial, target)
    lib = ctypes.CDLL(str(target))
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.paged_attention.argtypes = [p, i64, p, p, p, p, i64, p, p, p, i32, i32, i32, i32, i32, i32, i32,
                                    ctypes.c_float, i32]
    lib.paged_attention.restype = i32
    return lib


def available() -> bool:
    """Whether CPU calls run the C kernel (a compiler was found and the build succeeded)."""
    return _library() is not None


@dataclass
class _Plan:
    """One step's rows split between the kernel and torch_ref; built on the first layer, reused by the others."""

    kernel_rows: torch.Tensor  # [n] int32, rows with query_len <= MAX_KERNEL_QUERY_LEN
    max_context: int  # the longest seq_len among kernel_rows (scratch size)
    reference: torch_ref._Plan  # the longer rows


def _make_plan(metadata: AttentionMetadata, block_size: int, device: torch.device) -> _Plan:
    short = [i for i, n in enumerate(metadata.query_lens_cpu) if 0 < n <= MAX_KERNEL_QUERY_LEN]
    long = [i for i, n in enumerate(metadata.query_lens_cpu) if n > MAX_KERNEL_QUERY_LEN]
    return _Plan(
        kernel_rows=torch.tensor(short, dtype=torch.int32),
        max_context=max((metadata.seq_lens_cpu[i] for i in short), default=0),
        reference=torch_ref.make_plan(metadata, block_size, device, rows=long),
    )


def _kernel_can_run(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> bool:
    return (
        not query.is_cuda and query.dtype in _DTYPE_CODES and kv_cache.dtype == query.dtype
        and kv_cache.is_contiguous() and query.stride(2) == 1 and query.stride(1) == query.shape[2]
        and metadata.block_table.dtype == torch.int32 and metadata.block_table.stride(1) == 1
        and _library() is not None
    )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """torch_ref.paged_attention's result, with short rows computed by the C kernel."""
    if not _kernel_can_run(query, kv_cache, metadata):
        return torch_ref.paged_attention(query, kv_cache, metadata, scale, k_scale, v_scale)
    plan = metadata.backend_plan
    if not isinstance(plan, _Plan):
        plan = metadata.backend_plan = _make_plan(metadata, kv_cache.shape[2], query.device)
    output = torch.zeros(query.shape, dtype=query.dtype)
    num_rows = plan.kernel_rows.numel()
    if num_rows:
        _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        query_start_loc = metadata.query_start_loc.to(torch.int32).contiguous()
        seq_lens = metadata.seq_lens.to(torch.int32).contiguous()
        status = _library().paged_attention(
            query.data_ptr(), query.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), output.data_ptr(),
            metadata.block_table.data_ptr(), metadata.block_table.stride(0), query_start_loc.data_ptr(),
            seq_lens.data_ptr(), plan.kernel_rows.data_ptr(), num_rows, query.shape[1], num_kv_heads, head_size,
            block_size, _DTYPE_CODES[query.dtype], plan.max_context, scale, torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("CPU attention kernel: could not allocate scratch memory or start its threads")
    torch_ref.run_plan(query, torch_ref.Cache(kv_cache, query.dtype, k_scale, v_scale), plan.reference, scale,
                       output)
    return output

"""Trainer -> engine weight sync: engine-side transfer backends (by name) and checksum helpers."""

from weight_transfer.base import (
    WeightTransferEngine,
    WeightUpdateInfo,
    get_engine_backend,
    known_engine_backends,
    register_engine_backend,
)
from weight_transfer.checksums import compare_checksums, hf_state_checksums, tensor_checksum

__all__ = [
    "WeightTransferEngine",
    "WeightUpdateInfo",
    "get_engine_backend",
    "known_engine_backends",
    "register_engine_backend",
    "compare_checksums",
    "hf_state_checksums",
    "tensor_checksum",
]

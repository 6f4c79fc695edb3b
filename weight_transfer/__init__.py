"""Trainer -> engine weight sync: sources, trainer and engine backends by name, clients and checksum helpers.

    engine = weight_transfer.trainer_init(NCCLTrainerInitInfo(...), client=HTTPWeightSyncClient(url), source=model)
    engine.send_weights(weight_version="step-7")
"""

from weight_transfer.base import (
    ModuleSource,
    ParamMeta,
    Replicate,
    Shard,
    SparseWeightPatch,
    StateDictSource,
    SyncStats,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightUpdateInfo,
    get_engine_backend,
    get_trainer_backend,
    known_engine_backends,
    layerwise_groups,
    register_engine_backend,
    register_trainer_backend,
    trainer_init,
)
from weight_transfer.checksums import compare_checksums, hf_state_checksums, tensor_checksum

__all__ = [
    "ModuleSource",
    "ParamMeta",
    "Replicate",
    "Shard",
    "SparseWeightPatch",
    "StateDictSource",
    "SyncStats",
    "TrainerWeightTransferEngine",
    "WeightSource",
    "WeightTransferEngine",
    "WeightUpdateInfo",
    "get_engine_backend",
    "get_trainer_backend",
    "known_engine_backends",
    "layerwise_groups",
    "register_engine_backend",
    "register_trainer_backend",
    "trainer_init",
    "compare_checksums",
    "hf_state_checksums",
    "tensor_checksum",
]

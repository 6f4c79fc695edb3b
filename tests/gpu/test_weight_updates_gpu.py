"""GPU tier: a bf16 engine with CUDA graphs takes float32 trainer weights; graphs replay the new weights."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from weight_transfer.checksums import hf_state_checksums
from weight_helpers import engine_greedy, read_state

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_update_matches_a_fresh_engine_on_the_new_checkpoint(checkpoints, arch):
    old, new = checkpoints(arch)
    kwargs = dict(device="cuda", dtype="bfloat16", max_model_len=128, kv_cache_memory_bytes=1 << 26)
    fresh = engine_greedy(LLM(new, **kwargs))
    llm = LLM(old, **kwargs)
    engine_greedy(llm)  # graphs captured and replayed with the old weights
    new_state = read_state(new)  # float32, on the CPU, as a trainer's master weights
    core = llm.engine_core
    core.init_weight_transfer_engine({"backend": "local"})
    core.start_weight_update()
    core.update_weights({"weights": {n: t.cuda() for n, t in new_state.items()}})  # device tensors in-process
    core.finish_weight_update(weight_version="v1")
    assert core.weight_checker(hf_state_checksums(new_state, dtype=torch.bfloat16))["match"]
    got = engine_greedy(llm)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in fresh]
    assert got[0].outputs[0].weight_versions[0][0] == "v1"

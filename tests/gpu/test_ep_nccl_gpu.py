"""GPU tier: expert parallelism of size 2 over NCCL (one GPU per rank, each its own tokens) against one GPU: same logits and routing."""

from __future__ import annotations

import pytest
import torch
from ep_group import DUMMY, EPGroup, run_steps
from test_ep_forward import RANK_STEPS
from tp_group import load_engine_model

pytestmark = pytest.mark.gpu
ATOL = 1e-3  # float32, but GPU kernels reduce in other orders than one GPU's


@pytest.fixture(scope="module")
def gpu_ep_group():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    group = EPGroup(2, "cuda")
    try:
        yield group
    finally:
        group.close()


@pytest.mark.parametrize("variant", ["per-expert", "stacked-experts"])
def test_ep2_over_nccl_matches_one_gpu(gpu_ep_group, tiny_checkpoint, variant):
    path = tiny_checkpoint("qwen3_moe", **({"stacked_experts": True} if variant == "stacked-experts" else {}))
    infos = gpu_ep_group.run("rank_info")
    assert [(i["rank"], i["size"], i["default_group"]) for i in infos] == [(0, 2, False), (1, 2, False)]
    ranks = gpu_ep_group.run_each("rank_steps", [(path, steps) for steps in RANK_STEPS])
    for rank, steps in enumerate(RANK_STEPS):
        expected = run_steps(load_engine_model(path, "cuda:0"), [s for s in steps if s != DUMMY])
        got = [s for s, step in zip(ranks[rank]["steps"], steps) if step != DUMMY]
        for g, e in zip(got, expected, strict=True):
            for gl, el in zip(g["logits"], e["logits"], strict=True):
                torch.testing.assert_close(gl, el, atol=ATOL, rtol=0)
            if e["routed"] is not None and e["routed"].shape[0]:
                assert torch.equal(g["routed"], e["routed"])

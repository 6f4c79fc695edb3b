"""Expert parallelism of size 2 (two gloo ranks, each its own tokens) against one rank: same logits and routing, checkpoint loading in both namings, weight sync of local experts, the group's life cycle."""

from __future__ import annotations

import pytest
import torch
from ep_group import DUMMY, EPGroup, run_steps
from safetensors.torch import load_file
from tp_group import BLOCKS_PER_SEQ, free_port, load_engine_model

from engine.distributed import ExpertParallelState, ep_all_gather, ep_all_reduce, get_ep

ATOL = 1e-5
A, B, C = [5, 17, 99, 230, 41], [300, 12, 7, 88, 150, 201, 33, 60, 9], [77, 501, 79]


def _blocks(i: int) -> list[int]:
    return list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))


# Each rank's steps (rows: tokens so far, num computed, blocks). Both ranks run as many forward passes;
# their batches differ in size, and in some steps one rank has no token or runs the dummy batch.
RANK_STEPS = [
    [  # rank 0: two prompts, then a decode of both, then nothing, then a dummy batch
        [(A, 0, _blocks(0)), (B[:4], 0, _blocks(1))],
        [(A + [7], len(A), _blocks(0)), (B, 4, _blocks(1))],
        [],
        DUMMY,
    ],
    [  # rank 1: nothing, then a dummy batch, then a prompt in two chunks
        [],
        DUMMY,
        [(C + A, 0, _blocks(0))],
        [(C + A + [3], len(C + A), _blocks(0))],
    ],
]


@pytest.fixture(scope="module")
def ep_group():
    group = EPGroup(2)
    try:
        infos = group.run("rank_info")
        assert [(i["rank"], i["size"], i["has_group"]) for i in infos] == [(0, 2, True), (1, 2, True)]
        assert not any(i["default_group"] for i in infos)  # the EP group is not torch.distributed's default group
        yield group
    finally:
        group.close()


@pytest.mark.parametrize("variant", ["per-expert", "stacked-experts", "dense-layer"])
def test_ep2_matches_ep1(ep_group, tiny_checkpoint, variant):
    overrides = {"per-expert": {}, "stacked-experts": {"stacked_experts": True},
                 "dense-layer": {"num_hidden_layers": 3, "mlp_only_layers": [1]}}[variant]
    path = tiny_checkpoint("qwen3_moe", **overrides)
    ranks = ep_group.run_each("rank_steps", [(path, steps) for steps in RANK_STEPS])
    assert ranks[0]["local_experts"] == [0, 1, 2, 3] and ranks[1]["local_experts"] == [4, 5, 6, 7]
    assert ranks[0]["w13_shape"] == [4, 64, 64]  # 4 of the 8 experts: [E_local, 2 * I, H]
    for rank, steps in enumerate(RANK_STEPS):
        expected = run_steps(load_engine_model(path), [s for s in steps if s != DUMMY])
        got = [s for s, step in zip(ranks[rank]["steps"], steps) if step != DUMMY]
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert len(g["logits"]) == len(e["logits"])
            for gl, el in zip(g["logits"], e["logits"]):
                torch.testing.assert_close(gl, el, atol=ATOL, rtol=0)
            if e["routed"] is None or e["routed"].shape[0] == 0:
                assert g["routed"] is None or g["routed"].shape[0] == 0
            else:  # global expert ids of this rank's own tokens, as one rank routes them
                assert torch.equal(g["routed"], e["routed"])
    routed = torch.cat([s["routed"] for r in ranks for s in r["steps"] if s["routed"] is not None])
    assert set(routed.flatten().tolist()) == set(range(8))  # both ranks' experts really serve tokens


def test_dummy_weights_are_the_one_rank_model_split(ep_group, tiny_checkpoint):
    """load_format="dummy": every rank draws every expert from the same seed and keeps its own, so the
    EP model computes the one-rank dummy model's logits."""
    from tp_group import load_dummy_model

    path = tiny_checkpoint("qwen3_moe")
    ranks = ep_group.run_each("rank_steps", [(path, steps, 7) for steps in RANK_STEPS])
    for rank, steps in enumerate(RANK_STEPS):
        expected = run_steps(load_dummy_model(path, seed=7), [s for s in steps if s != DUMMY])
        got = [s for s, step in zip(ranks[rank]["steps"], steps) if step != DUMMY]
        for g, e in zip(got, expected, strict=True):
            for gl, el in zip(g["logits"], e["logits"], strict=True):
                torch.testing.assert_close(gl, el, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def old_new(tiny_checkpoint):
    old = tiny_checkpoint("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    new = tiny_checkpoint("qwen3_moe", seed=1, num_hidden_layers=3, mlp_only_layers=[1])
    return old, load_file(f"{old}/model.safetensors"), load_file(f"{new}/model.safetensors")


def _expert_ids(names) -> set[int]:
    return {int(n.split(".experts.")[1].split(".")[0]) for n in names if ".experts." in n}


def test_weight_sync_lands_each_ranks_experts(ep_group, old_new):
    from weight_transfer.checksums import hf_state_checksums

    old, old_state, new_state = old_new
    ep_group.run("rank_load", old)
    weights = ep_group.run("rank_weights")
    # Each rank lists its own experts only, plus every shared tensor; together they are the checkpoint.
    assert _expert_ids(weights[0]["info"]) == {0, 1, 2, 3} and _expert_ids(weights[1]["info"]) == {4, 5, 6, 7}
    assert set(weights[0]["info"]) | set(weights[1]["info"]) == set(old_state)
    shared = {n for n in old_state if ".experts." not in n}
    assert shared <= set(weights[0]["info"]) and shared <= set(weights[1]["info"])
    for w in weights:
        assert w["checksums"] == hf_state_checksums({n: old_state[n] for n in w["info"]})

    items = sorted(new_state.items())  # every expert's tensor goes to every rank, as a trainer sends them
    for backend in ("local", "local_stable"):  # streamed landing, and the batched landing plan
        assert ep_group.run("rank_update", items, backend) == ["", ""]
        for w in ep_group.run("rank_weights"):
            assert w["checksums"] == hf_state_checksums({n: new_state[n] for n in w["info"]})  # the trainer's slice
        # The trainer's FULL checksums compare over what each rank holds: other ranks' experts are not "unexpected".
        for result in ep_group.run("rank_weight_checker", hf_state_checksums(new_state)):
            assert result["match"], result
        assert ep_group.run("rank_update", sorted(old_state.items()), backend) == ["", ""]

    # A bad tensor of an expert rank 0 does not hold is still rejected, by both ranks alike.
    remote = "model.layers.2.mlp.experts.6.down_proj.weight"
    bad = dict(new_state)
    bad[remote] = torch.zeros(3, 3)
    for message in ep_group.run("rank_update", sorted(bad.items())):
        assert "no weight was changed" in message and remote in message and "shape [3, 3]" in message
    bad = dict(new_state)
    bad["model.layers.0.mlp.experts.8.up_proj.weight"] = new_state["model.layers.0.mlp.experts.0.up_proj.weight"]
    for message in ep_group.run("rank_update", sorted(bad.items())):
        assert "'model.layers.0.mlp.experts.8.up_proj.weight': matches no parameter" in message
    for w in ep_group.run("rank_weights"):  # the rejected updates changed nothing
        assert w["checksums"] == hf_state_checksums({n: old_state[n] for n in w["info"]})
    # A baseline naming a weight the model does not have still does not match.
    baseline = {**hf_state_checksums(old_state), "model.layers.0.mlp.experts.9.up_proj.weight": "x"}
    for result in ep_group.run("rank_weight_checker", baseline):
        assert not result["match"] and result["unexpected"] == ["model.layers.0.mlp.experts.9.up_proj.weight"]


def test_lockstep_worker_builds_its_ep_group_and_runs_dummy_batches(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    port = free_port()  # the workers' EP group uses port + 1
    group = EPGroup(2)  # its own: each rank leaves the group it starts in for the one its worker builds
    try:
        ranks = group.run_each("rank_worker", [(path, port, 0), (path, port, 1)])
    finally:
        group.close()
    for rank, r in enumerate(ranks):
        assert (r["rank"], r["size"], r["size_after_shutdown"]) == (rank, 2, 1)
        assert r["local_experts"] == list(range(4 * rank, 4 * rank + 4))
        assert _expert_ids(r["expert_names"]) == set(r["local_experts"])


def test_ep_state_reinitializes_with_a_new_size():
    import torch.multiprocessing as mp
    from ep_group import reinit_main

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=reinit_main, args=(rank, ports, queue), daemon=True) for rank in range(3)]
    for p in procs:
        p.start()
    outs = sorted((queue.get(timeout=120) for _ in procs), key=lambda o: o["rank"])
    for p in procs:
        p.join(30)
    for out in outs:
        assert "error" not in out, out["error"]
        assert out["first"] == [0, 1, 2] and out["sum"] == [3.0, 3.0]
        assert "destroy_expert_parallel() first" in out["double_init"]
        assert out["after_destroy"] == (0, 1, None)
        assert not out["default_group"]
    assert outs[0]["second"] == [1, 1, 0, 0] and outs[1]["second"] == [1, 1, 0, 0]  # ranks swapped: rank 1 is EP rank 0
    assert outs[0]["second_state"] == (1, 2) and outs[1]["second_state"] == (0, 2)
    assert outs[2]["second"] == [2, 2] and outs[2]["second_state"] == (0, 1)  # alone: the identity


def test_size_one_is_the_identity_and_touches_nothing():
    rank, size, group = get_ep()
    assert (rank, size, group) == (0, 1, None)
    x = torch.randn(3, 4)
    assert ep_all_gather(x) is x and ep_all_reduce(x) is x
    assert not torch.distributed.is_initialized()


def test_experts_split_unevenly_and_more_ranks_than_experts_are_refused(tiny_checkpoint, monkeypatch):
    from engine.models.loader import load_hf_config, load_model
    from engine.models.moe import moe_blocks

    path = tiny_checkpoint("qwen3_moe")
    monkeypatch.setattr("engine.models.moe.get_ep", lambda: ExpertParallelState(rank=1, size=3))
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    assert [list(b.experts.local_experts) for b in moe_blocks(model)] == [[2, 3, 4]] * len(moe_blocks(model))  # 8 = 2 + 3 + 3
    monkeypatch.setattr("engine.models.moe.get_ep", lambda: ExpertParallelState(rank=0, size=9))
    with pytest.raises(ValueError, match=r"expert-parallel size \(9 = data_parallel_size\) exceeds the number of experts \(8\)"):
        load_model(path, load_hf_config(path), torch.float32, "cpu")


def test_experts_split_in_halves_sum_to_all_experts():
    """The reference experts skip ids outside [0, E_local) (another rank's, or -1 padding): two halves' outputs
    add up to the whole layer's, which is what the all-reduce of the EP forward relies on."""
    from engine.kernels.moe import fused_experts_ref

    torch.manual_seed(0)
    num_tokens, hidden, inter, num_experts = 6, 8, 4, 4
    x = torch.randn(num_tokens, hidden)
    w13, w2 = torch.randn(num_experts, 2 * inter, hidden), torch.randn(num_experts, hidden, inter)
    ids = torch.tensor([[0, 3], [1, 2], [2, 0], [3, 1], [0, 1], [2, 3]])
    weights = torch.rand(num_tokens, 2)
    full = fused_experts_ref(x, w13, w2, weights, ids)
    low = fused_experts_ref(x, w13[:2], w2[:2], weights, ids)  # experts 0, 1
    high = fused_experts_ref(x, w13[2:], w2[2:], weights, ids - 2)  # experts 2, 3 (0 and 1 become -2, -1)
    torch.testing.assert_close(low + high, full)
    padded = fused_experts_ref(x, w13, w2, weights, torch.full_like(ids, -1))
    assert torch.equal(padded, torch.zeros_like(x))

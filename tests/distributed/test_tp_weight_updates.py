"""Weight updates under tensor parallelism of size 2: every rank receives the full HF tensors and lands its own slice.

The ranks are real processes in a gloo group; a small client fans each weight-sync call out to
both, as an engine's executor does. Checked per rank: checksums() equal
hf_state_checksums(new weights, shards=that rank's weight_info()), and the model then decodes
the same greedy tokens as one rank loaded from the new checkpoint.
"""

from __future__ import annotations

import threading

import pytest
import torch
from tp_group import greedy, load_engine_model

from weight_transfer.base import trainer_init
from weight_transfer.checksums import compare_checksums, hf_state_checksums, shard_of
from weight_transfer.clients import WeightSyncClient
from weight_transfer.nccl import NCCLTrainerInitInfo
from weight_transfer.rdt_plan import element_runs
from weight_transfer.sparse_nccl import SparseNCCLTrainerInitInfo

PROMPTS = [[5, 17, 99, 230, 41], [300, 12, 7, 88, 150, 201, 33, 60, 9], [77, 501, 79]]
MAX_TOKENS = 5
# Covers every kind of shard: column (dim 0) and row (dim 1) parallel, a replicated KV head, vocab padding.
MIXED = ("llama", {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True, "vocab_size": 509})
VARIANTS = {"llama-mixed": MIXED, "qwen2-tied": ("qwen2", {}), "qwen3-tied": ("qwen3", {})}


class TPClient(WeightSyncClient):
    """One engine of the group's ranks: each call runs on every rank at once; rank 0's result is returned."""

    def __init__(self, group) -> None:
        self.group = group
        self.lock = threading.Lock()  # trainers call from background threads; one call on the pipes at a time

    def _call(self, method: str, *args):
        if method == "get_world_size":
            return self.group.size
        with self.lock:
            return self.group.run("rank_call", method, *args)[0]


def read_state(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


def assert_ranks_hold(group, state: dict[str, torch.Tensor]) -> list[dict]:
    """Each rank's checksums equal those of its slices of `state`; returns the ranks' weight_info()."""
    ranks = group.run("rank_weights")
    for rank, got in enumerate(ranks):
        expected = hf_state_checksums(state, shards=got["info"])
        aliases = [n for n in got["info"] if n not in state]  # a tied lm_head.weight is not in the checkpoint
        result = compare_checksums(got["checksums"], expected, optional=aliases)
        assert result["match"], (rank, result)
    return [r["info"] for r in ranks]


def sync_with(group, backend: str, new_state: dict[str, torch.Tensor]) -> None:
    client = TPClient(group)
    client.init_weight_transfer_engine({"backend": backend})
    client.start_weight_update()
    names = list(new_state)
    half = len(names) // 2  # two calls, as a trainer sends buckets
    client.update_weights({"weights": {n: new_state[n] for n in names[:half]}})
    client.update_weights({"weights": {n: new_state[n] for n in names[half:]}})
    client.finish_weight_update("v1")


@pytest.mark.parametrize("backend", ["local", "local_stable"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_update_lands_each_ranks_shard(tp_group, tiny_checkpoint, variant, backend):
    arch, overrides = VARIANTS[variant]
    old, new = tiny_checkpoint(arch, **overrides), tiny_checkpoint(arch, seed=1, **overrides)
    tp_group.run("rank_load", old)
    infos = assert_ranks_hold(tp_group, read_state(old))  # checkpoint loading landed the right slices

    new_state = read_state(new)
    for name, tensor in new_state.items():  # shapes are the full HF tensors' on every rank
        assert all(info[name]["shape"] == list(tensor.shape) for info in infos), name
    q = "model.layers.0.self_attn.q_proj.weight"
    half = new_state[q].shape[0] // 2  # query heads split in two
    assert [info[q]["shard"] for info in infos] == [{"dim": 0, "start": s, "size": half} for s in (0, half)]
    o = "model.layers.0.self_attn.o_proj.weight"
    assert [info[o]["shard"]["dim"] for info in infos] == [1, 1]
    assert infos[0]["model.norm.weight"]["shard"] is None

    sync_with(tp_group, backend, new_state)
    assert_ranks_hold(tp_group, new_state)
    expected_tokens = greedy(load_engine_model(new), PROMPTS, MAX_TOKENS)[1]
    assert tp_group.run("rank_greedy_loaded", PROMPTS, MAX_TOKENS) == [expected_tokens, expected_tokens]


def test_replicated_kv_head_and_vocab_padding_shards(tp_group, tiny_checkpoint):
    arch, overrides = MIXED
    tp_group.run("rank_load", tiny_checkpoint(arch, **overrides))
    infos = [r["info"] for r in tp_group.run("rank_weights")]
    k = "model.layers.0.self_attn.k_proj.weight"  # one KV head of 16 rows: both ranks hold all of it
    assert [info[k]["shard"] for info in infos] == [None, None]
    embed = "model.embed_tokens.weight"  # 509 rows: 255 on rank 0, 254 (and one padding row) on rank 1
    assert [info[embed]["shard"] for info in infos] == [{"dim": 0, "start": 0, "size": 255},
                                                        {"dim": 0, "start": 255, "size": 254}]
    with pytest.raises(ValueError, match="outside the tensor"):
        shard_of(torch.zeros(10, 4), {"shard": {"dim": 0, "start": 8, "size": 4}}, "w")
    with pytest.raises(ValueError, match="shards"):
        hf_state_checksums({"w": torch.zeros(2)}, shards=[("w", None)])


def test_a_bad_update_is_refused_on_every_rank_and_changes_nothing(tp_group, tiny_checkpoint):
    arch, overrides = MIXED
    old = tiny_checkpoint(arch, **overrides)
    tp_group.run("rank_load", old)
    client = TPClient(tp_group)
    client.init_weight_transfer_engine({"backend": "local"})
    client.start_weight_update()
    name = "model.layers.0.mlp.down_proj.weight"
    local_shaped = read_state(old)[name][:, :64]  # a rank's slice is not what a trainer sends
    with pytest.raises(RuntimeError, match=r"shape \[64, 64\] does not match the model's \[64, 128\]") as e:
        client.update_weights({"weights": {name: local_shaped}})
    assert "rank 0" in str(e.value) and "rank 1" in str(e.value)
    client.abort_weight_update()
    assert_ranks_hold(tp_group, read_state(old))


@pytest.mark.parametrize("backend", ["nccl", "sparse_nccl"])
def test_nccl_group_has_one_rank_per_tp_worker(tp_group, tiny_checkpoint, backend):
    """The trainer broadcasts to both workers (a group of 3: trainer + 2); sparse patches are in full-tensor
    coordinates, and each rank applies those inside its slice."""
    from transformers import AutoModelForCausalLM

    arch, overrides = MIXED
    tp_group.run("rank_load", tiny_checkpoint(arch, **overrides))
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch, seed=1, **overrides), dtype=torch.float32)
    info_cls = SparseNCCLTrainerInitInfo if backend == "sparse_nccl" else NCCLTrainerInitInfo
    info = info_cls("127.0.0.1", 0, 3, packed_buffer_size_bytes=256 << 10, timeout_s=60.0)
    trainer = trainer_init(info, client=TPClient(tp_group), source=model)
    try:
        trainer.send_weights(weight_version="v1")
        assert_ranks_hold(tp_group, {n: p.detach() for n, p in model.named_parameters()})
        if backend == "sparse_nccl":
            gen = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for p in model.parameters():  # a few coordinates of every tensor
                    changed = torch.randperm(p.numel(), generator=gen)[: max(1, p.numel() // 100)]
                    p.view(-1)[changed] += 0.5
            stats = trainer.send_weights(weight_version="v2")
            assert stats.extra["num_dense"] == 0 and stats.extra["num_patches"] == stats.num_tensors
            assert_ranks_hold(tp_group, {n: p.detach() for n, p in model.named_parameters()})
    finally:
        trainer.shutdown()


def test_sharded_rdt_plans_to_pull_only_each_ranks_slices(tp_group, tiny_checkpoint):
    """sharded_rdt's BAKE runs the loaders on placeholders: each rank pulls exactly the bytes of its shards."""
    arch, overrides = MIXED
    path = tiny_checkpoint(arch, **overrides)
    tp_group.run("rank_load", path)
    state = read_state(path)
    names, tensors = list(state), list(state.values())
    ranges = tp_group.run("rank_bake", names, [t.dtype for t in tensors], [tuple(t.shape) for t in tensors])
    infos = [r["info"] for r in tp_group.run("rank_weights")]
    for rank in range(2):
        for name, tensor in state.items():
            view = shard_of(tensor, infos[rank][name], name)
            size = tensor.element_size()
            expected = [(a * size, b * size) for a, b in element_runs(view.storage_offset(), view.shape, view.stride())]
            assert ranges[rank][name] == expected, (rank, name)
    o = "model.layers.0.self_attn.o_proj.weight"  # row parallel: each rank pulls half of every row
    pulled = [sum(b - a for a, b in r[o]) for r in ranges]
    assert pulled == [state[o].numel() * 2, state[o].numel() * 2]  # 4 bytes a float, half the tensor each

"""Elastic EP's expert redistribution (engine/worker/elastic_ep.py) over real gloo groups of spawned processes: experts reach their new owners, uneven ranges, dense weights from rank 0."""

from __future__ import annotations

import datetime
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from tp_group import free_port

from engine.worker.elastic_ep import expert_range, expert_ranges

NUM_EXPERTS, HIDDEN, INTERMEDIATE, NUM_LAYERS = 8, 4, 3, 2


def test_expert_ranges_are_contiguous_and_cover_every_expert_once():
    for size in range(1, NUM_EXPERTS + 1):
        ranges = expert_ranges(NUM_EXPERTS, size)
        assert [e for r in ranges for e in r] == list(range(NUM_EXPERTS))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    assert expert_ranges(8, 3) == [range(2), range(2, 5), range(5, 8)]
    assert expert_ranges(8, 2, 3) == [range(4), range(4, 8), None]
    assert expert_range(8, 1, 2) == range(4, 8)  # what an evenly divided group holds (engine.models.moe)
    with pytest.raises(ValueError, match=r"exceeds the number of experts \(2\)"):
        expert_range(2, 0, 3)


def _full_weights(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + layer)
    return (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen),
            torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen))


def _model():
    from torch import nn

    from engine.models.moe import FusedExperts

    model = nn.Module()
    model.dense = nn.Linear(HIDDEN, HIDDEN, bias=False)
    model.layers = nn.ModuleList(FusedExperts(NUM_EXPERTS, HIDDEN, INTERMEDIATE) for _ in range(NUM_LAYERS))
    return model


CASES = [(2, 3), (3, 2), (1, 3), (3, 1)]  # (old EP size, new EP size) over a group of WORLD processes
WORLD = 3


def _rank_main(rank: int, port: int, conn) -> None:
    """Runs every case on one gloo group of WORLD ranks (ranks past a case's sizes hold nothing before / after)."""
    try:
        import torch.distributed as dist

        from engine.worker.elastic_ep import broadcast_dense_weights, redistribute_experts

        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=timeout, wait_for_workers=True)
        group = dist.ProcessGroupGloo(dist.PrefixStore("elastic", store), rank, WORLD, timeout)
        results = {}
        for old_size, new_size in CASES:
            model = _model()  # built outside any EP group: every expert, zeros (a joining rank's stale experts)
            old, new = expert_ranges(NUM_EXPERTS, old_size, WORLD), expert_ranges(NUM_EXPERTS, new_size, WORLD)
            with torch.no_grad():
                model.dense.weight.fill_(7.0 if rank == 0 else -1.0)
                for layer, experts in enumerate(model.layers):
                    w13, w2 = _full_weights(layer)
                    if old[rank] is not None:
                        r = old[rank]
                        experts.set_local_experts(r, w13[r.start:r.stop].clone(), w2[r.start:r.stop].clone())
            broadcast_dense_weights(model, group, src=0)
            redistribute_experts(model, group, rank, old, new)
            result = {"dense": model.dense.weight.unique().tolist(), "layers": []}
            for layer, experts in enumerate(model.layers):
                w13, w2 = _full_weights(layer)
                r = experts.local_experts
                result["layers"].append({
                    "local": list(r),
                    "w13_ok": torch.equal(experts.w13_weight.data, w13[r.start:r.stop]),
                    "w2_ok": torch.equal(experts.w2_weight.data, w2[r.start:r.stop]),
                    "names": [p.name for p in experts.w2_weight.hf_parts],
                    "param_local": list(experts.w13_weight.local_experts),
                })
            results[(old_size, new_size)] = result
        conn.send((True, results))
        group.shutdown()
    except BaseException:  # noqa: BLE001 - the traceback goes back to the test
        conn.send((False, traceback.format_exc()))


@pytest.fixture(scope="module")
def redistributed() -> list[dict]:
    """Each rank's results of every case."""
    ctx = mp.get_context("spawn")
    port = free_port()
    conns, procs = [], []
    for rank in range(WORLD):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank_main, args=(rank, port, child), daemon=True)
        proc.start()
        conns.append(parent)
        procs.append(proc)
    try:
        results = []
        for rank, conn in enumerate(conns):
            assert conn.poll(120), f"rank {rank} did not answer"
            ok, value = conn.recv()
            assert ok, f"rank {rank}:\n{value}"
            results.append(value)
        return results
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


@pytest.mark.parametrize(("old_size", "new_size"), CASES)
def test_redistribute_experts_moves_every_expert_to_its_new_owner(redistributed, old_size, new_size):
    new = expert_ranges(NUM_EXPERTS, new_size, WORLD)
    for rank, results in enumerate(redistributed):
        result = results[(old_size, new_size)]
        assert result["dense"] == [7.0]  # rank 0's dense weights everywhere
        for layer in result["layers"]:
            if new[rank] is None:  # a leaving rank keeps what it had; it serves nothing afterwards
                continue
            assert layer["local"] == layer["param_local"] == list(new[rank])
            assert layer["w13_ok"] and layer["w2_ok"]
            assert layer["names"] == [f"{e}.down_proj.weight" for e in new[rank]]

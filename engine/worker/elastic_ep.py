"""Elastic expert parallelism, the worker's side: move experts between EP ranks when the group changes size, and rebuild the EP group.

The expert-to-rank map is a function of (num_experts, EP size) only: rank r of size s holds the
contiguous experts expert_range(E, r, s) = [r * E // s, (r + 1) * E // s) (uneven when s does
not divide E). There are no redundant (replicated) experts yet, so "recomputing the redundant
experts" on a size change is recomputing this map; every expert has exactly one owner before
and after.

A size change S -> N moves experts over a group that holds every rank involved:

    grow (N > S):   the new EP group (size N); the joining ranks S..N-1 own nothing yet
    shrink (N < S): the old EP group (size S), before it is torn down; the leaving ranks N..S-1 own
                    nothing afterwards

    old owners:  | rank 0: [0, 4) | rank 1: [4, 8) |                        E = 8, S = 2 -> N = 3
    new owners:  | rank 0: [0, 2) | rank 1: [2, 5) | rank 2: [5, 8) |

For each MoE layer and each old owner o whose experts another rank needs, o broadcasts its stacked
expert tensors over the group; every rank copies the part of them its new range covers. The
parameters keep their identity (their .data is swapped, as sleep mode does), so loaders, the
parameter index and weight-transfer bindings stay valid; their `hf_parts` and `local_experts`
describe the new range.

A joining rank also needs the group's current non-expert weights (it loaded the checkpoint, the
group may have been updated since): rank 0 broadcasts every other parameter (broadcast_dense_weights).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.models.moe import FusedExperts, local_expert_range


def expert_range(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """The global ids of the experts EP rank `ep_rank` of `ep_size` holds: the map the MoE layers are built with
    (engine.models.moe.local_expert_range; contiguous, sizes differ by at most one)."""
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"EP rank {ep_rank} is out of range [0, {ep_size})")
    return local_expert_range(num_experts, ep_rank, ep_size)


def expert_ranges(num_experts: int, ep_size: int, num_ranks: int | None = None) -> list[range | None]:
    """expert_range of ranks 0..ep_size-1, then None (owns nothing) up to num_ranks entries."""
    num_ranks = ep_size if num_ranks is None else num_ranks
    return [expert_range(num_experts, r, ep_size) if r < ep_size else None for r in range(num_ranks)]


def fused_experts_modules(model: nn.Module) -> list[FusedExperts]:
    """The model's FusedExperts modules, in layer order."""
    return [m for m in model.modules() if isinstance(m, FusedExperts)]


def _broadcast(group, tensor: torch.Tensor, src: int) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = src, 0
    group.broadcast([tensor], options).wait()


@torch.no_grad()
def redistribute_experts(
    model: nn.Module,
    group,
    group_rank: int,
    old_ranges: Sequence[range | None],
    new_ranges: Sequence[range | None],
) -> None:
    """Moves every MoE layer's experts from their old owners to their new ones over `group` (a c10d ProcessGroup).

    old_ranges / new_ranges: per rank of `group`, the experts it holds before / after (None: none;
    a rank with None before may hold anything - a joining rank's checkpoint experts - and sends
    nothing). Every rank of the group calls this with the same ranges. A rank with None after
    keeps its tensors untouched (it is leaving). Collective: the same broadcasts in the same order
    everywhere.
    """
    size = len(old_ranges)
    if len(new_ranges) != size:
        raise ValueError(f"old_ranges has {size} entries, new_ranges {len(new_ranges)}")
    mine = new_ranges[group_rank]
    for experts in fused_experts_modules(model):
        w13, w2 = experts.w13_weight.data, experts.w2_weight.data
        new_w13 = w13.new_empty((len(mine), *w13.shape[1:])) if mine is not None else None
        new_w2 = w2.new_empty((len(mine), *w2.shape[1:])) if mine is not None else None
        for owner, owned in enumerate(old_ranges):
            if not owned:
                continue
            needed_elsewhere = any(
                r != owner and held is not None and set(held) & set(owned) for r, held in enumerate(new_ranges)
            )
            if group_rank == owner:
                src_w13, src_w2 = w13, w2
            elif needed_elsewhere:
                src_w13 = w13.new_empty((len(owned), *w13.shape[1:]))
                src_w2 = w2.new_empty((len(owned), *w2.shape[1:]))
            else:
                continue
            if needed_elsewhere:
                _broadcast(group, src_w13, owner)
                _broadcast(group, src_w2, owner)
            if mine is None:
                continue
            #   owned:  [o.start ............ o.stop)
            #   mine:          [m.start .............. m.stop)
            #   copied:        [lo ...... hi)  -> rows lo - o.start of src, lo - m.start of new
            lo, hi = max(owned.start, mine.start), min(owned.stop, mine.stop)
            if lo < hi:
                new_w13[lo - mine.start:hi - mine.start].copy_(src_w13[lo - owned.start:hi - owned.start])
                new_w2[lo - mine.start:hi - mine.start].copy_(src_w2[lo - owned.start:hi - owned.start])
        if mine is not None:
            experts.set_local_experts(mine, new_w13, new_w2)


@torch.no_grad()
def broadcast_dense_weights(model: nn.Module, group, src: int = 0) -> None:
    """Every parameter but the experts' from rank `src` of `group` to all of its ranks (in place)."""
    skip = {id(p) for m in fused_experts_modules(model) for p in (m.w13_weight, m.w2_weight)}
    for _name, param in model.named_parameters():
        if id(param) not in skip:
            _broadcast(group, param.data, src)


def set_block_ep(model: nn.Module, ep_rank: int, ep_size: int) -> None:
    """Tells every MoE block its EP rank and size (they choose between the local and the expert-parallel forward)."""
    from engine.models.moe import moe_blocks

    for block in moe_blocks(model):
        block.ep_rank, block.ep_size = ep_rank, ep_size


def reconfigure_worker(worker, plan: dict) -> None:
    """A worker's part of an elastic EP size change (every worker of the old and new groups at once).

    plan (engine/dp_core_proc.py DPEngineCoreProc.reconfigure_elastic_ep): old_size, new_size,
    old_rank (None: joining), new_rank (None: leaving), ep_init_method (the new EP group's
    rendezvous, "tcp://HOST:PORT", hosted by new rank 0).

        grow:    leave the old EP group, join the new one; rank 0 broadcasts the dense weights;
                 experts move over the new group
        shrink:  experts move over the old group; leave it; the staying ranks join the new one
    """
    from engine.distributed.parallel_state import destroy_expert_parallel, get_ep, init_expert_parallel
    from engine.models.hf_layout import hf_remote_shapes, hf_weight_layout

    old_size, new_size = plan["old_size"], plan["new_size"]
    old_rank, new_rank = plan["old_rank"], plan["new_rank"]
    model, updater = worker.model, worker.weight_updater
    if updater.updating:
        raise RuntimeError("reconfigure_elastic_ep: a weight update is in progress; finish or abort it first")
    backend = "nccl" if worker.device.type == "cuda" else "gloo"
    worker.drop_cuda_graphs()  # they recorded the old expert tensors and the old forward path
    modules = fused_experts_modules(model)
    num_experts = modules[0].num_experts if modules else 0

    def join_new() -> None:
        destroy_expert_parallel()
        if new_rank is not None:
            init_expert_parallel(new_size, new_rank, plan["ep_init_method"], backend=backend)

    if new_size > old_size:
        join_new()
        group = get_ep().group
        broadcast_dense_weights(model, group, src=0)
        if modules:
            redistribute_experts(model, group, new_rank, expert_ranges(num_experts, old_size, new_size),
                                 expert_ranges(num_experts, new_size))
    else:
        if modules:
            redistribute_experts(model, get_ep().group, old_rank, expert_ranges(num_experts, old_size),
                                 expert_ranges(num_experts, new_size, old_size))
        join_new()
    if new_rank is not None:
        set_block_ep(model, new_rank, new_size)
    # The HF-name view of the model changed with the experts it holds; a backend that planned against
    # the loaders (sharded_rdt) plans again. A transport whose world size counts the engines' workers
    # (nccl) needs init_weight_transfer_engine again for the new size: the trainer's side changed too.
    updater.layout, updater.remote = hf_weight_layout(model), hf_remote_shapes(model)
    updater._plans, updater._plans_for = {}, ()
    if updater.transfer_engine is not None:
        updater.transfer_engine.bind_model(model)
    worker.capture_cuda_graphs()  # every rank at once (a no-op on CPU)

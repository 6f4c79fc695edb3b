"""Sparse mixture-of-experts layer: router, stacked expert weights that load per-expert HF tensors, expert parallelism, and routing capture for RL replay.

Expert parallelism (EP, engine.distributed.get_ep()): EP rank r of size s holds the contiguous
experts [r * E / s, (r + 1) * E / s) of every layer; the router is replicated. Each rank routes
its own tokens, then the block dispatches by all-gather and combines by all-reduce (see
SparseMoeBlock._forward_expert_parallel): every rank must run the same number of forward passes,
a rank without tokens included (the engine's dummy batch).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import ep_all_gather, ep_all_reduce, get_ep, get_tp
from engine.kernels.moe import fused_experts, select_experts
from engine.models.layers import _new_param, _param_index, load_part, make_part

# HF names of expert weights, relative to a MoE block's `experts` module:
#   per expert (hub checkpoints, transformers' save_pretrained):  experts.{e}.gate_proj.weight / up_proj / down_proj
#   stacked (transformers v5 in-memory state_dict):               experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I]
_PER_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(?P<module>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_SHARD_OF = {"gate_proj": 0, "up_proj": 1, "down_proj": None}  # gate rows first, then up rows, in w13


def check_no_tensor_parallelism(what: str) -> None:
    """MoE layers are not split by tensor parallelism (their experts are sharded by expert parallelism instead)."""
    tp_size = get_tp().size
    if tp_size > 1:
        raise ValueError(
            f"{what}: mixture-of-experts models run with tensor_parallel_size 1 only (shard the experts with "
            f"enable_expert_parallel over data_parallel_size engines instead); got tensor_parallel_size={tp_size}"
        )


def local_expert_range(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """The global ids of the experts EP rank `ep_rank` holds: a contiguous run of about num_experts / ep_size
    (sizes differ by at most one when ep_size does not divide num_experts; elastic EP resizes to any size).

        E = 8, ep_size = 2:   rank 0 -> [0, 4)   rank 1 -> [4, 8)
        E = 8, ep_size = 3:   rank 0 -> [0, 2)   rank 1 -> [2, 5)   rank 2 -> [5, 8)
    """
    if ep_size > num_experts:
        raise ValueError(
            f"the expert-parallel size ({ep_size} = data_parallel_size) exceeds the number of experts ({num_experts})"
        )
    return range(ep_rank * num_experts // ep_size, (ep_rank + 1) * num_experts // ep_size)


class FusedExperts(nn.Module):
    """This EP rank's experts of one layer (all of them without expert parallelism) as two stacked parameters:

        w13_weight [E_local, 2 * I, H]   entry j = global expert local_experts[j]: [gate_proj (I) | up_proj (I)]
        w2_weight  [E_local, H, I]       entry j: down_proj

    Each knows the per-expert HF tensors it holds (hf_parts: "{e}.gate_proj.weight" ... with the
    GLOBAL expert id e in the name and its entry as `index`), so checkpoint loading and weight sync
    land one expert's tensor at a time, and a rank's weight_info lists only the experts it holds.
    Both parameters carry `local_experts` (range of global ids) and `num_experts` (global count).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        ep = get_ep()
        self.num_experts = num_experts  # of the whole model
        local = local_expert_range(num_experts, ep.rank, ep.size)
        I, H = intermediate_size, hidden_size
        self.w13_weight = _new_param(len(local), 2 * I, H, loader=self.weight_loader)
        self.w2_weight = _new_param(len(local), H, I, loader=self.weight_loader)
        for param in (self.w13_weight, self.w2_weight):
            param.num_experts = num_experts
        self.set_local_experts(local, self.w13_weight.data, self.w2_weight.data)

    def set_local_experts(self, local_experts: range, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Holds the global experts `local_experts` from now on, as the stacked tensors w13 [len, 2I, H] and w2 [len, H, I]
        (elastic EP moves experts between ranks). The parameters keep their identity; their data and HF parts change."""
        I, H = w2.shape[2], w2.shape[1]
        self.local_experts, self.num_local_experts = local_experts, len(local_experts)
        self.w13_weight.data, self.w2_weight.data = w13, w2
        self.w13_weight.hf_parts = tuple(
            make_part((I, H), offset=shard * I, rows=I, index=j, name=f"{e}.{proj}.weight")
            for j, e in enumerate(local_experts) for shard, proj in enumerate(("gate_proj", "up_proj"))
        )
        self.w2_weight.hf_parts = tuple(
            make_part((H, I), index=j, name=f"{e}.down_proj.weight") for j, e in enumerate(local_experts)
        )
        for param in (self.w13_weight, self.w2_weight):
            param.local_experts = local_experts

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None, expert_id: int | None = None
    ) -> None:
        """Loads one expert's tensor (global expert_id; shard_id 0 gate / 1 up for w13, None for w2), or, with
        expert_id None, the whole stacked tensor of every expert (transformers' in-memory layout), of which
        this rank keeps its experts' entries. Another rank's expert is shape-checked and skipped."""
        if expert_id is None:
            full_shape = (self.num_experts, *param.shape[1:])
            if tuple(loaded_weight.shape) != full_shape:
                raise ValueError(f"shape mismatch: expected {full_shape}, loaded {tuple(loaded_weight.shape)}")
            param.data.copy_(loaded_weight.narrow(0, self.local_experts.start, self.num_local_experts))
            return
        if not isinstance(expert_id, int) or not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id!r} out of range for {self.num_experts} experts")
        parts = param.hf_parts
        per_expert = len(parts) // self.num_local_experts
        shard = 0 if shard_id is None else shard_id
        if not isinstance(shard, int) or not 0 <= shard < per_expert:
            raise ValueError(f"shard_id {shard_id!r} out of range for {per_expert} tensors per expert")
        if expert_id not in self.local_experts:  # another EP rank's: the same shapes as ours, nothing lands
            if tuple(loaded_weight.shape) != parts[shard].full_shape:
                expected = parts[shard].full_shape
                raise ValueError(f"shape mismatch: expected {expected}, loaded {tuple(loaded_weight.shape)}")
            return
        load_part(param, parts[(expert_id - self.local_experts.start) * per_expert + shard], loaded_weight)

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts' share of the MoE output: pairs routed to other ranks' experts add nothing."""
        start = self.local_experts.start
        local_ids = topk_ids - start if start else topk_ids  # [T, K]; outside [0, E_local): another rank's expert
        return fused_experts(hidden, self.w13_weight, self.w2_weight, topk_weights, local_ids)  # [T, H]


class Router(nn.Module):
    """The router (HF `mlp.gate`): one logit per expert, replicated. [T, H] -> [T, E]."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = _new_param(num_experts, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)


class SparseMoeBlock(nn.Module):
    """router -> softmax -> top-k experts per token (renormalized when norm_topk_prob) -> weighted sum of their outputs.

    Shared experts: none here (Qwen3-MoE has none); a family with them adds its dense expert beside this block.

    Routing capture (rollout routing replay): while `capture_routing` is on, each forward keeps the
    (global) expert ids every token of this rank was routed to in `routed_expert_ids` ([T, K] int32, best first).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, norm_topk_prob: bool):
        super().__init__()
        check_no_tensor_parallelism(type(self).__name__)
        ep = get_ep()
        self.ep_rank, self.ep_size = ep.rank, ep.size
        self.top_k, self.norm_topk_prob = top_k, bool(norm_topk_prob)
        self.gate = Router(hidden_size, num_experts)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)
        self.capture_routing = False
        self.routed_expert_ids: torch.Tensor | None = None  # [T, K] int32 of the last forward, when capturing

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        router_logits = self.gate(hidden)  # [T, E]
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.norm_topk_prob)  # [T, K] each
        if self.capture_routing:
            self.routed_expert_ids = topk_ids.to(torch.int32)
        if self.ep_size == 1:
            return self.experts(hidden, topk_weights, topk_ids)
        return self._forward_expert_parallel(hidden, topk_weights, topk_ids)

    def _forward_expert_parallel(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:  # [T, H]
        """Dispatch by all-gather, combine by all-reduce (every rank calls this once per forward, T may be 0).

        Each rank's tokens are padded to the group's largest count M and gathered in rank order:

            gathered rows:  | rank 0: T_0 tokens, pad | rank 1: T_1 tokens, pad | ...    [size * M]
                              ^ 0                       ^ M

        Padding rows carry weight 0 and id -1 (no expert). Every rank runs its own experts over all
        gathered rows (ids outside its range add nothing), the all-reduce sums the partial outputs
        so each row gets every expert's share, and each rank keeps its own rows.
        """
        num_tokens, hidden_size = hidden.shape
        counts = ep_all_gather(torch.tensor([num_tokens], device=hidden.device)).tolist()  # one host sync per layer
        max_tokens = max(counts)
        if max_tokens == 0:  # no rank has a token: nothing to exchange (every rank sees the same counts)
            return torch.zeros_like(hidden)
        pad = max_tokens - num_tokens
        payload = F.pad(torch.cat([hidden, topk_weights.to(hidden.dtype)], dim=1), (0, 0, 0, pad))  # [M, H + K], pad: 0
        ids = F.pad(topk_ids.to(torch.int32), (0, 0, 0, pad), value=-1)  # [M, K], pad: -1
        payload, ids = ep_all_gather(payload), ep_all_gather(ids)  # [size * M, H + K], [size * M, K]
        out = self.experts(payload[:, :hidden_size], payload[:, hidden_size:], ids)  # [size * M, H] partial
        ep_all_reduce(out)  # sum over ranks: every expert's share
        first = self.ep_rank * max_tokens
        return out[first:first + num_tokens]


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's MoE blocks, in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def set_routing_capture(model: nn.Module, enabled: bool) -> None:
    """Switches routing capture on or off in every MoE block (clearing what was captured)."""
    for block in moe_blocks(model):
        block.capture_routing = enabled
        block.routed_expert_ids = None


def routed_expert_ids(model: nn.Module) -> torch.Tensor | None:
    """[num_tokens, num_moe_layers, top_k] int32: the experts each token of the last forward was routed
    to in each MoE layer (layer order, best first); None when capture is off or nothing ran yet."""
    captured = [block.routed_expert_ids for block in moe_blocks(model)]
    if not captured or any(ids is None for ids in captured):
        return None
    return torch.stack(captured, dim=1)


def split_expert_weights(
    module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Lands the expert tensors of `weights` (either HF naming, see above) through FusedExperts'
    loader, adding each stacked parameter to `loaded` once all its local experts' tensors came;
    yields the rest. Under expert parallelism another rank's expert is shape-checked and skipped."""
    params = _param_index(module)
    seen: dict[str, set] = {}
    for name, tensor in weights:
        match = _PER_EXPERT.match(name)
        if match:
            proj, expert_id = match["proj"], int(match["expert"])
            param_name = f"{match['module']}.{'w2_weight' if proj == 'down_proj' else 'w13_weight'}"
            key, args = (expert_id, proj), (_SHARD_OF[proj], expert_id)
        else:
            match = _STACKED.match(name)
            if not match:
                yield name, tensor
                continue
            param_name = f"{match['module']}.{'w2_weight' if match['proj'] == 'down_proj' else 'w13_weight'}"
            key, args = "all", ()
        param = params.get(param_name)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
        try:
            param.weight_loader(param, tensor, *args)
        except ValueError as e:
            raise ValueError(f"parameter {param_name!r} (from {name!r}): {e}") from None
        if key != "all" and key[0] not in param.local_experts:
            continue  # another EP rank's expert: checked, not held here
        keys = seen.setdefault(param_name, set())
        keys.add(key)
        if "all" in keys or len(keys) == len(param.hf_parts):
            loaded.add(param_name)

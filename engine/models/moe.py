"""Sparse mixture-of-experts layer: router, stacked expert weights that load per-expert HF tensors, and routing capture for RL replay."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.distributed import get_tp
from engine.kernels.moe import fused_experts, select_experts
from engine.models.layers import _new_param, _param_index, default_weight_loader, load_part, make_part

# HF names of expert weights, relative to a MoE block's `experts` module:
#   per expert (hub checkpoints, transformers' save_pretrained):  experts.{e}.gate_proj.weight / up_proj / down_proj
#   stacked (transformers v5 in-memory state_dict):               experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I]
_PER_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(?P<module>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_SHARD_OF = {"gate_proj": 0, "up_proj": 1, "down_proj": None}  # gate rows first, then up rows, in w13


def check_no_tensor_parallelism(what: str) -> None:
    """MoE layers run unsharded for now: a clear error instead of wrong shards."""
    tp_size = get_tp().size
    if tp_size > 1:
        raise ValueError(
            f"{what}: mixture-of-experts models run with tensor_parallel_size 1 only for now "
            f"(expert parallelism is not implemented yet); got tensor_parallel_size={tp_size}"
        )


class FusedExperts(nn.Module):
    """The experts of one layer as two stacked parameters:

        w13_weight [E, 2 * I, H]   expert e's rows: [gate_proj (I) | up_proj (I)]
        w2_weight  [E, H, I]       expert e: down_proj

    Each knows the per-expert HF tensors it holds (hf_parts: "{e}.gate_proj.weight" ... with the
    expert as `index`), so checkpoint loading and weight sync land one expert's tensor at a time.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        I, H = intermediate_size, hidden_size
        w13_parts = tuple(
            make_part((I, H), offset=shard * I, rows=I, index=e, name=f"{e}.{proj}.weight")
            for e in range(num_experts) for shard, proj in enumerate(("gate_proj", "up_proj"))
        )
        w2_parts = tuple(make_part((H, I), index=e, name=f"{e}.down_proj.weight") for e in range(num_experts))
        self.w13_weight = _new_param(num_experts, 2 * I, H, loader=self.weight_loader, parts=w13_parts)
        self.w2_weight = _new_param(num_experts, H, I, loader=self.weight_loader, parts=w2_parts)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None, expert_id: int | None = None
    ) -> None:
        """Loads one expert's tensor (expert_id; shard_id 0 gate / 1 up for w13, None for w2), or, with
        expert_id None, the whole stacked tensor of every expert (transformers' in-memory layout)."""
        if expert_id is None:
            default_weight_loader(param, loaded_weight)
            return
        if not isinstance(expert_id, int) or not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id!r} out of range for {self.num_experts} experts")
        parts = param.hf_parts
        per_expert = len(parts) // self.num_experts
        shard = 0 if shard_id is None else shard_id
        if not isinstance(shard, int) or not 0 <= shard < per_expert:
            raise ValueError(f"shard_id {shard_id!r} out of range for {per_expert} tensors per expert")
        load_part(param, parts[expert_id * per_expert + shard], loaded_weight)

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)  # [T, H]


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
    expert ids every token was routed to in `routed_expert_ids` ([T, K] int32, best first).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, norm_topk_prob: bool):
        super().__init__()
        check_no_tensor_parallelism(type(self).__name__)
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
        return self.experts(hidden, topk_weights, topk_ids)


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
    loader, adding each stacked parameter to `loaded` once all its tensors came; yields the rest."""
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
        keys = seen.setdefault(param_name, set())
        keys.add(key)
        if "all" in keys or len(keys) == len(param.hf_parts):
            loaded.add(param_name)

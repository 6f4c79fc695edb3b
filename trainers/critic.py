"""The PPO critic: a value model (the checkpoint's decoder backbone plus a scalar head) sharded with FSDP2 and trained with its own AdamW."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine.model_source import resolve_checkpoint
from trainers.config import ModelConfig, OptimConfig, check_range
from trainers.policy import clip_and_step, gather_response_rows


@dataclass
class CriticConfig:
    """The value model: the checkpoint's backbone with a scalar head, trained with the clipped value loss."""

    lr: float = 1e-5
    """Critic learning rate (AdamW; betas, eps and weight decay come from optim)."""
    max_grad_norm: float = 1.0
    """Clip the critic's gradient norm to this; 0 turns clipping off (the norm is still logged)."""
    value_clip: float | None = 0.2
    """How far a value may move from its rollout-time estimate before the clipped loss takes over; none: no clipping."""
    path: str | None = None
    """HF checkpoint directory or hub name ORG/NAME[@revision] of the critic's backbone; none: model.path (the policy's starting checkpoint)."""

    def __post_init__(self) -> None:
        check_range("critic.lr", self.lr, 0.0, low_open=True)
        check_range("critic.max_grad_norm", self.max_grad_norm, 0.0)
        if self.value_clip is not None and not (self.value_clip > 0.0 and math.isfinite(self.value_clip)):
            raise ValueError(f"critic.value_clip: must be a finite number > 0 or none, got {self.value_clip}")
        if self.path is not None:
            self.path = resolve_checkpoint(self.path, field="critic.path")


class ValueModel(nn.Module):
    """A decoder backbone (HF AutoModel, no LM head) and a linear head giving one value [B, L, 1] per position."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, use_cache=False).last_hidden_state  # [B, L, H]
        # Written out rather than self.value_head(hidden): nn.Linear on 3-D input returns a view, and
        # FSDP2 cannot keep its backward hook on a view the caller might modify in place.
        return hidden @ self.value_head.weight.t() + self.value_head.bias  # [B, L, 1]


def load_sharded_value_model(path: str, model_config: ModelConfig) -> ValueModel:
    """The checkpoint's backbone plus a fresh value head in float32, each decoder layer and then the root fully_shard'ed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModel

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call trainers.policy.init_distributed() first")
    device = torch.device("cuda", torch.cuda.current_device()) if model_config.device == "cuda" else torch.device("cpu")
    backbone = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    # Every rank seeds the head alike (the caller's torch.manual_seed), so the unsharded head agrees across ranks.
    model = ValueModel(backbone, backbone.config.hidden_size).to(device)
    model.eval()  # no dropout: values of the same tokens must not depend on the pass
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if model_config.param_dtype == "bfloat16" else None,
        reduce_dtype=torch.float32,
    )
    for layer in getattr(backbone, "layers", []):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


class Critic:
    """The FSDP2-sharded value model with its own AdamW."""

    def __init__(self, model_config: ModelConfig, critic_config: CriticConfig, optim_config: OptimConfig) -> None:
        self.config = critic_config
        self.device_type = model_config.device
        self.model = load_sharded_value_model(critic_config.path or model_config.path, model_config)
        self.optimizer = torch.optim.AdamW(
            list(self.model.parameters()),
            lr=critic_config.lr,
            betas=(optim_config.beta1, optim_config.beta2),
            eps=optim_config.eps,
            weight_decay=optim_config.weight_decay,
        )

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" else torch.device("cpu")

    def response_values(self, input_ids: torch.Tensor, prompt_lens: torch.Tensor, num_response_positions: int) -> torch.Tensor:
        """V(s_t) [B, R]: the value of the state just before response token t (the position whose logits predict it)."""
        values = self.model(input_ids.to(self.device)).float()  # [B, L, 1]
        rows = gather_response_rows(values, prompt_lens.to(self.device), num_response_positions)  # [B, R, 1]
        return rows.squeeze(-1)  # [B, R]

    def optimizer_step(self) -> dict[str, float]:
        return clip_and_step(list(self.model.parameters()), self.optimizer, self.config.max_grad_norm)



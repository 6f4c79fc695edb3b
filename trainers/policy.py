"""The trained policy: an HF checkpoint under FSDP2 with AdamW, per-token logprobs/entropy of responses, and HF-format saving.

    rank, world_size = init_distributed("cpu")        # torchrun's env, or a single-process gloo group
    policy = Policy(ModelConfig(path=DIR), OptimConfig(lr=1e-5))
    logprobs, entropy = policy.response_logprobs(input_ids, prompt_lens, response_ids, temperature=1.0)
    loss.backward(); policy.optimizer_step()
    policy.save("runs/x/final")                        # every rank calls it; rank 0 writes
"""

from __future__ import annotations

import math
import os
import socket
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainers.config import LoRAConfig, ModelConfig, OptimConfig
from weight_transfer import ModuleSource
from weight_transfer.lora import adapter_source


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: str = "cpu") -> tuple[int, int]:
    """(rank, world_size) of the default process group, creating it if needed: from torchrun's
    environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) when set, else a single-process group
    on a free loopback port. gloo on CPU, NCCL on CUDA."""
    if device == "cuda":  # before NCCL starts: each rank owns one GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor (an FSDP2-sharded parameter, or a norm reduced over its shards)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def clip_and_step(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, max_grad_norm: float) -> dict[str, float]:
    """Clips the gradient norm (0: off), steps the optimizer unless the norm is non-finite, clears gradients."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)
    if is_dtensor(norm):
        norm = norm.full_tensor()
    grad_norm = float(norm)
    # Every rank sees the same (reduced) norm, so every rank takes the same branch.
    skipped = not math.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm, "step_skipped": float(skipped)}


def mean_over_ranks(metrics: dict[str, float], world_size: int, device: torch.device) -> dict[str, float]:
    """Each metric averaged over all ranks (every rank must call it with the same keys)."""
    if world_size == 1:
        return metrics
    names = sorted(metrics)  # same keys on every rank: same config, same code path
    values = torch.tensor([metrics[n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(values)
    return dict(zip(names, (values / world_size).tolist()))


def peft_lora_config(lora: LoRAConfig):
    """PEFT's LoraConfig of the adapter `lora` describes (no dropout: the engine has none)."""
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.targets, lora_dropout=0.0,
                      use_rslora=lora.use_rslora, bias="none", task_type="CAUSAL_LM")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of an HF causal LM, or of the one a PEFT model wraps (each becomes an FSDP2 unit)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(getattr(getattr(base, "model", None), "layers", []))


def load_sharded_model(config: ModelConfig, *, trainable: bool = True, lora: LoRAConfig | None = None) -> nn.Module:
    """The checkpoint's HF model in float32, each decoder layer and then the root fully_shard'ed over all ranks.

    With `lora` (rank > 0) the model is PEFT's: a fresh adapter (B = 0, so it starts as the base model)
    on the frozen base, and only the adapter's tensors train. Dropout is off (eval mode) for good: the
    engine has none, and trainer and engine logprobs must agree on the same weights.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call trainers.policy.init_distributed() first")
    device = torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" else torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(config.path, dtype=torch.float32, attn_implementation="sdpa")
    model.requires_grad_(trainable)
    if lora is not None and lora.enabled:
        from peft import get_peft_model

        model = get_peft_model(model, peft_lora_config(lora))  # freezes the base, the adapter trains
    model.to(device)
    model.eval()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if config.param_dtype == "bfloat16" else None,
        reduce_dtype=torch.float32,
    )
    # Per-layer units: only one layer's full parameters are alive at a time in forward/backward.
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def gather_response_rows(
    logits: torch.Tensor, prompt_lens: torch.Tensor, num_response_positions: int
) -> torch.Tensor:
    """The logits that predict each response token: row prompt_lens[b] - 1 + j for response position j.

    Sequences are prompt + response + right padding, so the response starts at a different
    column per row:
        input_ids   p0 p1 p2 r0 r1 r2 pad
        logits      .  .  ^  ^  ^         (the logits at column t predict token t + 1)
    Positions past a row's end are clamped to its last column; they are masked out downstream.
    """
    batch, length, vocab = logits.shape
    offsets = torch.arange(num_response_positions, device=logits.device)  # [R]
    rows = (prompt_lens.to(logits.device).unsqueeze(1) - 1 + offsets).clamp(max=length - 1)  # [B, R]
    return logits.gather(1, rows.unsqueeze(-1).expand(batch, num_response_positions, vocab))  # [B, R, V]


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logprobs [B, R] of token_ids under softmax(logits / temperature) [B, R, V], and that distribution's entropy [B, R].

    entropy_grad=False computes the entropy off the autograd graph (a metric only: no [B, R, V] kept for backward).
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = F.log_softmax(logits, dim=-1)  # [B, R, V]
    chosen = logp.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # [B, R]
    entropy = None
    if with_entropy:
        source = logp if entropy_grad else logp.detach()
        entropy = -(source.exp() * source).sum(-1)  # [B, R]
    return chosen, entropy


class Policy:
    """The FSDP2-sharded policy (and, with `reference=True`, a frozen copy of the initial weights for KL).

    With `lora` (rank > 0) only a LoRA adapter on the frozen base trains: the weight source is that
    adapter (a sync moves its tensors only), save() writes a PEFT adapter directory, and the reference
    is the same model with its adapter switched off (the initial policy, without a second copy).
    """

    def __init__(self, model_config: ModelConfig, optim_config: OptimConfig, *, reference: bool = False,
                 lora: LoRAConfig | None = None) -> None:
        self.config = model_config
        self.optim_config = optim_config
        self.lora = lora if lora is not None and lora.enabled else None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.model = load_sharded_model(model_config, lora=self.lora)
        self.has_reference = reference  # with LoRA: the adapter-off forward, not self.reference
        self.reference = load_sharded_model(model_config, trainable=False) if reference and self.lora is None else None
        # The engine's forward for the logprobs (model.invariant_forward); the HF forward keeps the gradients.
        self.invariant = self.invariant_reference = None
        if model_config.invariant_forward:  # InvariantForward refuses a LoRA (PEFT) policy
            from engine.models.loader import load_hf_config
            from trainers.invariant_forward import InvariantForward

            hf_config = load_hf_config(model_config.path)  # as the engine reads it
            dtype = torch.bfloat16 if model_config.param_dtype == "bfloat16" else torch.float32  # the engine's
            self.invariant = InvariantForward(self.model, hf_config, dtype, self.device)
            if self.reference is not None:
                self.invariant_reference = InvariantForward(self.reference, hf_config, dtype, self.device)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=optim_config.lr,
            betas=(optim_config.beta1, optim_config.beta2),
            eps=optim_config.eps,
            weight_decay=optim_config.weight_decay,
        )

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.config.device == "cuda" else torch.device("cpu")

    def weight_source(self):
        """The trained parameters under their HF names, gathered one tensor at a time when sent; with LoRA the
        adapter's tensors under PEFT's saved names, aimed at the engine's adapter lora.name."""
        if self.lora is not None:
            return adapter_source(self.model, self.lora.name)
        return ModuleSource(self.model)

    def response_logprobs(
        self,
        input_ids: torch.Tensor,
        prompt_lens: torch.Tensor,
        response_ids: torch.Tensor,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = True,
        use_reference: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token logprobs [B, R] of response_ids (and entropy [B, R]) in one forward of the policy.

        input_ids [B, L] is prompt + response, right-padded; prompt_lens [B]; response_ids [B, R].
        Right padding needs no attention mask: causal attention never lets a real token see
        the padding after it. Gradients flow unless called under torch.no_grad() or use_reference.
        With model.invariant_forward the values are the batch-invariant engine's (trainers/invariant_forward.py;
        bit for bit on CUDA) and the gradient is the HF forward's (straight-through).
        """
        if use_reference and not self.has_reference:
            raise ValueError("use_reference: this Policy was built without reference=True")
        model = self.reference if use_reference and self.lora is None else self.model
        # The LoRA policy's reference: its base, the adapter switched off for this forward.
        adapter_off = model.disable_adapter() if use_reference and self.lora is not None else nullcontext()
        if input_ids.dim() != 2 or response_ids.dim() != 2 or prompt_lens.shape != (input_ids.shape[0],):
            raise ValueError(
                f"input_ids [B, L], prompt_lens [B], response_ids [B, R] expected, got {list(input_ids.shape)}, "
                f"{list(prompt_lens.shape)}, {list(response_ids.shape)}"
            )
        device = self.device
        invariant = self.invariant_reference if use_reference else self.invariant
        if invariant is not None:
            # The engine's numbers (trainers/invariant_forward.py); with autograd on, the HF forward's gradient
            # rides on them (straight-through: the values stay exactly the invariant forward's).
            values, entropy_values = invariant.response_logprobs(input_ids, prompt_lens, response_ids, temperature,
                                                                 with_entropy)
            if use_reference or not torch.is_grad_enabled():
                return values, entropy_values
        with torch.no_grad() if use_reference else nullcontext(), adapter_off:
            logits = model(input_ids=input_ids.to(device), use_cache=False).logits  # [B, L, V]
            rows = gather_response_rows(logits, prompt_lens.to(device), response_ids.shape[1])  # [B, R, V]
            logprobs, entropy = token_logprobs_and_entropy(rows, response_ids.to(device), temperature, with_entropy,
                                                           entropy_grad)
        if invariant is None:
            return logprobs, entropy
        from trainers.invariant_forward import straight_through

        if entropy is not None:
            entropy = straight_through(entropy, entropy_values) if entropy.requires_grad else entropy_values
        return straight_through(logprobs, values), entropy

    def optimizer_step(self) -> dict[str, float]:
        """Clips the gradient norm, steps AdamW and clears gradients; a non-finite norm skips the step."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        metrics = clip_and_step(params, self.optimizer, self.optim_config.max_grad_norm)
        return {**metrics, "lr": self.optimizer.param_groups[0]["lr"]}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer gathered in full on CPU, on rank 0 (empty elsewhere); every rank must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save(self, path: str) -> str | None:
        """Writes an HF checkpoint (config, safetensors, tokenizer) that `rollout launch` loads, or with LoRA a PEFT
        adapter directory (adapter_config.json, adapter_model.safetensors: `--lora-modules`, add_lora); every rank
        calls, rank 0 writes."""
        from transformers import AutoTokenizer

        state = self.full_state_dict()
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            # PeftModel.save_pretrained keeps only the adapter's entries of the full state.
            self.model.save_pretrained(path, state_dict=state, safe_serialization=True)
            AutoTokenizer.from_pretrained(self.config.path).save_pretrained(path)
        if dist.is_initialized():
            dist.barrier()  # nobody reads a half-written checkpoint
        return path if self.rank == 0 else None

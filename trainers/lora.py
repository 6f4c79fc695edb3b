"""The rollout side of LoRA training: the policy's adapter loaded into the rollout engine, and the worker view whose every generation runs with it.

    lora = LoRAConfig(rank=16)
    policy = Policy(model_config, optim_config, lora=lora)       # PEFT adapter on the frozen base
    worker = attach_adapter(worker, policy, lora, "runs/x/lora-init")
    worker.generate(prompts, params)                             # with the adapter, as the trainer computes
    sync = make_weight_sync(rollout, worker.engine, policy.weight_source(), rank)   # moves adapter tensors only

The engine learns the adapter's rank, targets and scaling from a PEFT directory the trainer saves
before its first step (B = 0: the base model's outputs); every later sync replaces its tensors and
labels them with the step's weight_version, which the adapter's requests then report.
"""

from __future__ import annotations

from typing import Any

from engine.lora.request import LoRARequest
from trainers.config import LoRAConfig

# The adapter's lora_int_id in an engine this trainer loads it into (add_lora names adapters by id).
LORA_INT_ID = 1


def lora_worker_args(lora: LoRAConfig) -> dict[str, Any]:
    """The RolloutWorker arguments that let it serve the policy's adapter: LoRA on, one slot of its rank."""
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": lora.rank}


class AdapterWorker:
    """A rollout worker whose generate / agenerate run with one adapter and whose get_weight_version is that
    adapter's; every other attribute is the wrapped worker's (controls, tokenizer, shutdown...).

    Works over a RolloutWorker, trainers.engines.RayRolloutEngine and HTTPRolloutEngine alike: each takes
    lora_request on its generation calls (over HTTP the adapter's name becomes the request's `model`).
    """

    def __init__(self, engine, lora_request: LoRARequest) -> None:
        self.engine = engine
        self.lora_request = lora_request

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False) -> list:
        return self.engine.generate(prompts, sampling_params, use_tqdm, lora_request=self.lora_request)

    async def agenerate(self, prompt, sampling_params=None):
        return await self.engine.agenerate(prompt, sampling_params, lora_request=self.lora_request)

    def get_weight_version(self, lora_name: str | None = None) -> str:
        """The adapter's weight version (the one its requests' tokens are labelled with); lora_name: another's."""
        return self.engine.get_weight_version(lora_name or self.lora_request.lora_name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def attach_adapter(engine, policy, lora: LoRAConfig, directory: str) -> AdapterWorker:
    """Saves the policy's adapter (as it is now) to `directory` as a PEFT adapter and loads it into `engine` under
    lora.name; the view of `engine` that generates with it. Every trainer rank must call it (saving gathers the
    sharded adapter); pass engine=None on ranks without one (returns None there).

    An HTTP server needs --enable-lora --max-lora-rank >= lora.rank and runtime adapter loading
    (--allow-runtime-lora-updating) with `directory` inside its --allowed-lora-paths."""
    policy.save(directory)
    if engine is None:
        return None
    request = LoRARequest(lora.name, LORA_INT_ID, directory)
    if hasattr(engine, "add_lora"):
        engine.add_lora(request)
    else:  # a server: adapters are loaded by name over its /v1/load_lora_adapter route
        engine.load_lora_adapter(lora.name, directory)
    return AdapterWorker(engine, request)

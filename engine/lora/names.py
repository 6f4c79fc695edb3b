"""LoRAAdapters: the adapters a frontend serves by name, as vLLM's server keeps them (load_lora_adapter, `model`)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Awaitable, Callable

from engine.exceptions import InvalidUserInputError, LoRAAdapterNotFoundError
from engine.lora.request import LoRARequest


class LoRAAdapters:
    """lora_name -> LoRARequest of the adapters loaded by name (vLLM's OpenAIServingModels.lora_requests),
    each under the next lora_int_id (1, 2, ...). Plain Python: the engine does the reading (add_lora).

    A name is recorded only once the engine has read and validated its adapter, so a failed load leaves
    everything as it was. Loads and unloads run one at a time (one lock, not one per name: a name from
    the network must not leave anything behind). A reload under a known name (load_inplace) takes a new
    id: requests already running with the old adapter finish with it, new ones get the new weights, and
    no prefix-cache block of the old weights is reused.
    """

    def __init__(self, base_model_name: str) -> None:
        self.base_model_name = base_model_name
        self._by_name: dict[str, LoRARequest] = {}
        self._next_id = itertools.count(1)
        self._lock = asyncio.Lock()

    def get(self, lora_name: str | None) -> LoRARequest | None:
        return self._by_name.get(lora_name) if lora_name is not None else None

    def all(self) -> list[LoRARequest]:
        """Every adapter, in load order."""
        return list(self._by_name.values())

    async def load(self, lora_name: str, lora_path: str, load_inplace: bool, *,
                   add: Callable[[LoRARequest], Awaitable[object]],
                   remove: Callable[[int], Awaitable[object]]) -> LoRARequest:
        """Reads the adapter through `add` (the engine's add_lora) and records it under lora_name; a reload
        (load_inplace) then forgets the previous one through `remove`. InvalidUserInputError for a missing
        name or path, the base model's name, or a name loaded already without load_inplace (vLLM's 400s);
        the engine's ValueError naming what is wrong with the adapter."""
        if not lora_name or not lora_path:
            raise InvalidUserInputError("Both 'lora_name' and 'lora_path' must be provided.")
        if lora_name == self.base_model_name:
            raise InvalidUserInputError(f"The lora adapter '{lora_name}' conflicts with a served base model.")
        async with self._lock:
            previous = self._by_name.get(lora_name)
            if previous is not None and not load_inplace:
                raise InvalidUserInputError(
                    f"The lora adapter '{lora_name}' has already been loaded. If you want to load the adapter "
                    "in place, set 'load_inplace' to True.")
            lora = LoRARequest(lora_name, next(self._next_id), lora_path)
            await add(lora)
            self._by_name[lora_name] = lora
            if previous is not None:
                await remove(previous.lora_int_id)
            return lora

    async def unload(self, lora_name: str, *, remove: Callable[[int], Awaitable[object]]) -> LoRARequest:
        """Forgets the adapter (and has the engine drop it through `remove`); LoRAAdapterNotFoundError
        when no adapter has this name, InvalidUserInputError for an empty one (vLLM's 404 and 400)."""
        if not lora_name:
            raise InvalidUserInputError("'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._lock:
            lora = self._by_name.pop(lora_name, None)
            if lora is None:
                raise LoRAAdapterNotFoundError(f"The lora adapter '{lora_name}' cannot be found.")
            await remove(lora.lora_int_id)
            return lora


def check_lora_adapter_layout(is_3d_lora_weight: object) -> None:
    """vLLM's is_3d_lora_weight (a MoE adapter's stacked expert layout): this engine has no MoE LoRA."""
    if is_3d_lora_weight is not False:
        raise ValueError(f"is_3d_lora_weight: only false is supported (no LoRA on MoE experts), got {is_3d_lora_weight!r}")

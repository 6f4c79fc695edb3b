"""LoRA adapters in the server: --lora-modules (vLLM's two forms) loaded at start-up, and the directories
/v1/load_lora_adapter may read from (--allowed-lora-paths).

vLLM reads whatever lora_path a client sends (an absolute path, ~, a relative one, else a hub repo id),
so anyone who reaches its runtime route can make the server open any directory it can read, and tell
from the answers what exists. Here a runtime load reads only inside the directories the operator lists
(symlinks and '..' resolved first, so neither leads out), "*" restoring vLLM's any-path behaviour; a
path outside them is refused before anything is opened, so the answer says nothing about it. Nothing
is downloaded. The operator's own --lora-modules are not checked.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from engine.exceptions import LoRAAdapterNotFoundError

ANY_PATH = "*"
_JSON_KEYS = {"name", "path", "base_model_name", "is_3d_lora_weight"}


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules entry (vLLM's LoRAModulePath): the adapter's served name and its directory."""

    name: str
    path: str
    base_model_name: str | None = None  # vLLM's; this server serves one base model, so it must be that one


def parse_lora_modules(entries: list[str] | None) -> list[LoRAModulePath]:
    """vLLM's --lora-modules items: `name=path` (an item with "=" and no ","), else a JSON object
    {"name", "path", "base_model_name"?, "is_3d_lora_weight"?}. ValueError naming the bad item."""
    modules: list[LoRAModulePath] = []
    for item in entries or []:
        if not item:
            continue  # vLLM skips empty items
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
            module = LoRAModulePath(name, path)
        else:
            try:
                fields = json.loads(item)
            except json.JSONDecodeError:
                raise ValueError(f"lora_modules: {item!r} is neither name=path nor a JSON object") from None
            if not isinstance(fields, dict) or not {"name", "path"} <= set(fields) or set(fields) - _JSON_KEYS:
                raise ValueError(f"lora_modules: {item!r} must be a JSON object with name and path "
                                 f"(and optionally base_model_name, is_3d_lora_weight)")
            if fields.get("is_3d_lora_weight", False) is not False:
                raise ValueError(f"lora_modules: {item!r}: is_3d_lora_weight must be false (no LoRA on MoE experts)")
            module = LoRAModulePath(fields["name"], fields["path"], fields.get("base_model_name"))
        for key in ("name", "path"):
            if not isinstance(getattr(module, key), str) or not getattr(module, key):
                raise ValueError(f"lora_modules: {item!r} has no {key}")
        if any(m.name == module.name for m in modules):
            raise ValueError(f"lora_modules: the name {module.name!r} is given twice")
        modules.append(module)
    return modules


async def load_lora_modules(engine: Any, modules: list[LoRAModulePath], served_name: str) -> None:
    """Loads each adapter under its name (load_lora_adapter, ids in the given order); ValueError naming the
    first that fails (vLLM's server does not start then either)."""
    for module in modules:
        if module.base_model_name is not None and module.base_model_name != served_name:
            raise ValueError(f"lora_modules: {module.name}: base_model_name {module.base_model_name!r} is not "
                             f"the served model {served_name!r}")
        try:
            await engine.load_lora_adapter(module.name, module.path)
        except (ValueError, LookupError) as e:
            raise ValueError(f"lora_modules: {module.name}={module.path}: {e}") from None


class LoRAPathPolicy:
    """Which directories a runtime load may read (see the module docstring); its check() is the route's Check."""

    def __init__(self, allowed: list[str]) -> None:
        self.allowed = list(allowed)
        self.any_path = ANY_PATH in self.allowed
        self.roots = [os.path.realpath(os.path.expanduser(d)) for d in self.allowed if d != ANY_PATH]

    def check(self, arguments: dict[str, Any]) -> None:
        """Refuses a lora_path outside the allowed directories (ValueError) and a directory that is not there
        (LoRAAdapterNotFoundError: vLLM's 404 and words); the engine then reads the resolved path."""
        path, name = arguments["lora_path"], arguments["lora_name"]
        if not path or not name:
            return  # the frontend's own check names what is missing
        if not self.allowed:
            raise ValueError("lora_path: this server reads no adapter directory at runtime; start it with "
                             "--allowed-lora-paths DIR [DIR ...] (or * for any path, as vLLM)")
        resolved = os.path.realpath(os.path.expanduser(path))
        if not self.any_path and not any(_inside(resolved, root) for root in self.roots):
            raise ValueError(f"lora_path: {path!r} is not inside the server's --allowed-lora-paths {self.allowed}")
        if not os.path.isdir(resolved):
            raise LoRAAdapterNotFoundError(f"Loading lora {name} failed: No adapter found for {path}")
        arguments["lora_path"] = resolved


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)

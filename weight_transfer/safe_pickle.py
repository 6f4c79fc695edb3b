"""Unpickling with an allow-list: the only way weight_transfer reads a pickle it did not write.

vLLM's wire carries pickles in two places: `ipc_handles_pickled` (CUDA-IPC rebuild tuples, sent
over HTTP) and the NCCL unique id its StatelessProcessGroup puts in the trainer's TCPStore. A
plain `pickle.loads` of either runs whatever callable the sender names, so each reader here names
the (module, qualname) globals it expects and `loads` refuses every other one:

    from weight_transfer import safe_pickle
    uid = safe_pickle.loads(raw, frozenset({("builtins", "bytes")}), what="NCCL unique id")

`allowed` is either a frozenset of (module, qualname) pairs, resolved by importing the module
and walking the dotted qualname, or a mapping from the pair to the object to hand back (so a
caller can substitute its own rebuild function for the one the pickle names). Everything else
- a global not listed, persistent ids, an input over `max_bytes` - raises ValueError naming
`what` and the refused thing. Reduce opcodes still run, but only on callables that passed the
allow-list, so a nested `os.system` inside an allowed tuple is refused at its `find_class`.
"""

from __future__ import annotations

import importlib
import io
import pickle
from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULT_MAX_BYTES", "loads"]

_Allowed = Mapping[tuple[str, str], Any] | frozenset[tuple[str, str]]

# Far above a NCCL unique id (128 bytes) or a few thousand IPC handles, far below a memory bomb.
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, allowed: _Allowed, what: str) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._what = what

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key not in self._allowed:
            raise ValueError(f"{self._what}: refused to unpickle global {module}.{name} (not in the allow-list)")
        if isinstance(self._allowed, Mapping):
            return self._allowed[key]
        return _resolve(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise ValueError(f"{self._what}: refused a pickle persistent id {pid!r}")


def loads(
    data: bytes,
    allowed: _Allowed,
    *,
    what: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Any:
    """Unpickle `data`, admitting only the globals in `allowed`; ValueError naming `what` otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"{what}: expected pickled bytes, got {type(data).__name__}")
    if not isinstance(allowed, (Mapping, frozenset)):
        kind = type(allowed).__name__
        raise TypeError(f"{what}: allowed must be a Mapping or frozenset of (module, qualname), got {kind}")
    size = len(data)
    if size > max_bytes:
        raise ValueError(f"{what}: pickle of {size} bytes is over the {max_bytes}-byte limit")
    if size == 0:
        raise ValueError(f"{what}: empty pickle")
    try:
        return _AllowListUnpickler(io.BytesIO(bytes(data)), allowed, what).load()
    except ValueError:
        raise
    except Exception as exc:  # truncated/garbled streams raise UnpicklingError, EOFError, KeyError...
        raise ValueError(f"{what}: not a readable pickle ({type(exc).__name__}: {exc})") from exc

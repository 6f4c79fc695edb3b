"""Import vLLM 0.33's pure-Python modules without running vLLM's compiled parts.

`make vllm033` (a prerequisite of `make test`) unpacks the vllm-0.33.0 wheel's Python files into
build/vllm033/site and installs the few pure-Python packages those modules import, without their
dependencies, into build/vllm033/deps (tests/compat/vllm033-deps.txt). Neither directory is on
sys.path for the rest of the suite: `import_vllm` puts them there the first time it is called.

vLLM's package `__init__` files import nearly all of vLLM (vllm/__init__ -> env_override, and
vllm/config/__init__ -> every config class -> transformers configs, xgrammar, ...). So for the
packages listed in DEFERRED_INIT the real `__init__.py` is *not* run on import: the package is
registered as a shell whose `__path__` points at the extracted directory, so its submodules import
from vLLM's own files as usual. The first time code asks the shell for a name it does not have
(`from vllm.config import VllmConfig`), the shell runs the real `__init__.py` in its own namespace
and answers from it - so a module that needs the whole package still gets it, and one that needs a
single submodule (vllm.config.weight_transfer) gets only that. Every other vLLM package imports
normally. vLLM's compiled extension (vllm._C, needing torch 2.14 + CUDA) is never imported: the
modules used here do not import it, and `loaded_compiled_modules()` lets a test assert so.

Usage, in a test:

    from compat.vllm_modules import import_vllm
    nccl_engine = import_vllm("vllm.distributed.weight_transfer.nccl_engine")

or take the `vllm_import` fixture (tests/compat/conftest.py), which skips with the reason when the
build is missing - and `make test` fails if the build is there and the tier still skipped.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("ROLLOUT_VLLM033_BUILD", REPO / "build" / "vllm033"))
SITE = BUILD / "site"  # vllm/ and vllm-0.33.0.dist-info/ from the wheel, Python files only
DEPS = BUILD / "deps"  # pure-Python imports of those modules, installed --no-deps
STAMP = BUILD / ".built"  # written last by `make vllm033`
VERSION = "0.33.0"

# Packages whose __init__ runs only when a name is asked of them (see the module docstring).
DEFERRED_INIT = frozenset({"vllm", "vllm.config", "vllm.model_executor", "vllm.model_executor.model_loader"})


class VllmUnavailable(ImportError):
    """The vLLM 0.33 build is missing or broken; the message says which and how to build it."""


def unavailable_reason() -> str | None:
    """None when the build is in place, else why not (used as the pytest skip reason)."""
    if not STAMP.is_file():
        return (
            f"vLLM {VERSION} compat build missing ({STAMP} not found): run `make vllm033` "
            "(make test runs it) to unpack the vllm wheel's Python files and their pure-Python deps"
        )
    if not (SITE / "vllm" / "distributed" / "weight_transfer" / "base.py").is_file():
        return f"vLLM {VERSION} compat build at {SITE} is incomplete: run `make clean-vllm033 vllm033`"
    return None


def _deferred_getattr(module: types.ModuleType, init_file: str):
    lock = threading.RLock()
    state = {"ran": False}

    def __getattr__(name: str):
        # Dunder probes (hasattr(m, "__file__"), pickling, inspect) must not pull in the whole package.
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        pkg_dir = os.path.dirname(init_file)
        if not state["ran"] and (
            os.path.isfile(os.path.join(pkg_dir, name + ".py")) or os.path.isdir(os.path.join(pkg_dir, name))
        ):
            # A submodule (`from vllm.config import weight_transfer`, or the import system's own
            # hasattr probe for a fromlist): import it alone, without the package's __init__.
            return importlib.import_module(f"{module.__name__}.{name}")
        with lock:
            if not state["ran"]:
                state["ran"] = True
                del module.__dict__["__getattr__"]  # the real __init__ may define its own
                code = compile(Path(init_file).read_bytes(), init_file, "exec")
                exec(code, module.__dict__)
        if name in module.__dict__:
            return module.__dict__[name]
        # A submodule asked for by attribute (`from vllm.config import parallel`).
        try:
            return importlib.import_module(f"{module.__name__}.{name}")
        except ModuleNotFoundError:
            pass
        getter = module.__dict__.get("__getattr__")
        if getter is not None:
            return getter(name)
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

    return __getattr__


class _DeferredInitLoader(importlib.abc.Loader):
    def __init__(self, init_file: str):
        self.init_file = init_file

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        module.__file__ = self.init_file
        module.__getattr__ = _deferred_getattr(module, self.init_file)


class _VllmFinder(importlib.abc.MetaPathFinder):
    """Finds vllm.* only under SITE (never an installed vllm), deferring the listed __init__s."""

    def __init__(self, site: Path):
        self.site = str(site)

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        if fullname in DEFERRED_INIT:
            pkg_dir = os.path.join(self.site, *fullname.split("."))
            init_file = os.path.join(pkg_dir, "__init__.py")
            spec = importlib.machinery.ModuleSpec(fullname, _DeferredInitLoader(init_file), is_package=True)
            spec.submodule_search_locations = [pkg_dir]
            spec.has_location = True
            spec.origin = init_file
            return spec
        if fullname == "vllm":  # pragma: no cover - vllm is always deferred
            return None
        # A subpackage or module: the path finder over its parent's __path__ (which is under SITE).
        return importlib.machinery.PathFinder.find_spec(fullname, path)


_setup_lock = threading.Lock()
_installed = False


def _install() -> None:
    global _installed
    with _setup_lock:
        if _installed:
            return
        reason = unavailable_reason()
        if reason is not None:
            raise VllmUnavailable(reason)
        stray = [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]
        if stray:
            raise VllmUnavailable(f"a vllm package was imported before import_vllm: {sorted(stray)[:5]}")
        # SITE holds vllm-0.33.0.dist-info, so importlib.metadata.version("vllm") answers 0.33.0
        # (vLLM's platform detection asks it). DEPS after it, both after the venv's own packages
        # would shadow nothing we rely on: DEPS holds only what the venv lacks.
        for p in (str(SITE), str(DEPS)):
            if p not in sys.path:
                sys.path.append(p)
        sys.meta_path.insert(0, _VllmFinder(SITE))
        _installed = True


def import_vllm(name: str) -> types.ModuleType:
    """Import vLLM 0.33's module `name` (e.g. "vllm.distributed.weight_transfer.nccl_engine") from
    the compat build and return it. Raises VllmUnavailable with the reason when the build is missing."""
    if name != "vllm" and not name.startswith("vllm."):
        raise ValueError(f"import_vllm: {name!r} is not a vllm module")
    _install()
    return importlib.import_module(name)


def loaded_compiled_modules() -> list[str]:
    """The vllm modules loaded from a compiled extension (.so); a test asserts this stays empty."""
    out = []
    for name, module in list(sys.modules.items()):
        if name == "vllm" or name.startswith("vllm."):
            origin = getattr(getattr(module, "__spec__", None), "origin", None) or ""
            if origin.endswith((".so", ".pyd")):
                out.append(name)
    return sorted(out)

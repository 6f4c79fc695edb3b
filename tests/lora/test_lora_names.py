"""LoRAAdapters (the adapters served by name) and --lora-modules parsing, without an engine: vLLM's rules and answers."""

from __future__ import annotations

import asyncio

import pytest

from engine.exceptions import InvalidUserInputError, LoRAAdapterNotFoundError
from engine.lora.names import LoRAAdapters
from rollout.server.lora import LoRAModulePath, LoRAPathPolicy, parse_lora_modules


class Engine:
    """Records add_lora / remove_lora; refuses the paths in `bad` as the engine would (ValueError)."""

    def __init__(self, bad: set[str] = frozenset()) -> None:
        self.bad, self.calls = bad, []

    async def add(self, lora) -> bool:
        self.calls.append(("add", lora.lora_int_id, lora.lora_path))
        if lora.lora_path in self.bad:
            raise ValueError(f"adapter_config.json: rank 64 is above max_lora_rank (16) in {lora.lora_path}")
        return True

    async def remove(self, lora_id: int) -> bool:
        self.calls.append(("remove", lora_id))
        return True


def _load(names: LoRAAdapters, engine: Engine, name: str, path: str, inplace: bool = False):
    return asyncio.run(names.load(name, path, inplace, add=engine.add, remove=engine.remove))


def test_each_load_gets_the_next_id_and_a_failed_one_changes_nothing():
    names, engine = LoRAAdapters("base"), Engine(bad={"/bad"})
    assert _load(names, engine, "a", "/a").lora_int_id == 1
    with pytest.raises(ValueError, match="rank 64 is above max_lora_rank"):
        _load(names, engine, "b", "/bad")
    assert names.get("b") is None and [lora.lora_name for lora in names.all()] == ["a"]
    assert _load(names, engine, "b", "/b").lora_int_id == 3  # an id is never reused


def test_vllms_refusals_of_a_load():
    names, engine = LoRAAdapters("base"), Engine()
    _load(names, engine, "a", "/a")
    with pytest.raises(InvalidUserInputError, match="'a' has already been loaded.*load_inplace"):
        _load(names, engine, "a", "/a2")
    with pytest.raises(InvalidUserInputError, match="conflicts with a served base model"):
        _load(names, engine, "base", "/x")
    with pytest.raises(InvalidUserInputError, match="Both 'lora_name' and 'lora_path' must be provided"):
        _load(names, engine, "c", "")
    assert names.get("a").lora_path == "/a" and engine.calls == [("add", 1, "/a")]


def test_load_inplace_takes_a_new_id_then_drops_the_old_adapter():
    names, engine = LoRAAdapters("base"), Engine(bad={"/bad"})
    _load(names, engine, "a", "/a")
    with pytest.raises(ValueError):
        _load(names, engine, "a", "/bad", inplace=True)
    assert names.get("a").lora_path == "/a"  # the old one still serves
    new = _load(names, engine, "a", "/a2", inplace=True)
    assert (new.lora_int_id, names.get("a")) == (3, new)
    assert engine.calls[-2:] == [("add", 3, "/a2"), ("remove", 1)]


def test_unload():
    names, engine = LoRAAdapters("base"), Engine()
    _load(names, engine, "a", "/a")
    asyncio.run(names.unload("a", remove=engine.remove))
    assert names.all() == [] and engine.calls[-1] == ("remove", 1)
    with pytest.raises(LoRAAdapterNotFoundError, match="The lora adapter 'a' cannot be found."):
        asyncio.run(names.unload("a", remove=engine.remove))


def test_lora_modules_in_vllms_two_forms():
    assert parse_lora_modules(["a=/x/a", '{"name": "b", "path": "/x/b", "base_model_name": "m"}', ""]) == [
        LoRAModulePath("a", "/x/a"), LoRAModulePath("b", "/x/b", "m")]
    with pytest.raises(ValueError, match="neither name=path nor a JSON object"):
        parse_lora_modules(["a,b"])
    with pytest.raises(ValueError, match="must be a JSON object with name and path"):
        parse_lora_modules(['{"name": "a"}'])
    with pytest.raises(ValueError, match="the name 'a' is given twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="has no name"):
        parse_lora_modules(["=/x"])


def test_the_path_policy_resolves_symlinks_and_dots_before_it_decides(tmp_path):
    allowed, outside = tmp_path / "adapters", tmp_path / "secret"
    (allowed / "a").mkdir(parents=True)
    outside.mkdir()
    (allowed / "link").symlink_to(outside)
    policy = LoRAPathPolicy([str(allowed)])
    arguments = {"lora_name": "a", "lora_path": str(allowed / "x" / ".." / "a")}
    policy.check(arguments)
    assert arguments["lora_path"] == str(allowed / "a")  # the engine reads the resolved path
    for escape in (allowed / "link", allowed / ".." / "secret", tmp_path / "adapters-evil"):
        with pytest.raises(ValueError, match="is not inside the server's --allowed-lora-paths"):
            policy.check({"lora_name": "a", "lora_path": str(escape)})
    with pytest.raises(LoRAAdapterNotFoundError, match="No adapter found for"):
        policy.check({"lora_name": "a", "lora_path": str(allowed / "missing")})
    with pytest.raises(ValueError, match="reads no adapter directory at runtime"):
        LoRAPathPolicy([]).check({"lora_name": "a", "lora_path": str(allowed / "a")})
    LoRAPathPolicy(["*"]).check({"lora_name": "a", "lora_path": str(outside)})  # vLLM's any path

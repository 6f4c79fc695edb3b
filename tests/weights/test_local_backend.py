"""The local backend's update_info formats, the backend registry and the checksum helpers (no engine)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from weight_transfer.base import (
    StateDictSource,
    WeightTransferEngine,
    get_engine_backend,
    register_engine_backend,
    trainer_init,
)
from weight_transfer.checksums import compare_checksums, hf_state_checksums, tensor_checksum
from weight_transfer.clients import WeightSyncClient
from weight_transfer.local import LocalTrainerInitInfo, LocalWeightTransferEngine, encode_weights_b64, make_update_info


@pytest.fixture
def backend():
    engine = LocalWeightTransferEngine(torch.device("cpu"))
    engine.init_transfer(engine.parse_init_info({"backend": "local"}))
    return engine


def _received(backend, update_info) -> dict[str, torch.Tensor]:
    info = backend.parse_update_info(update_info)
    return dict(backend.receive_weights(info))


def test_b64_round_trip_keeps_dtype_shape_and_bits(backend):
    weights = {
        "a.weight": torch.randn(3, 5, dtype=torch.bfloat16),
        "b.weight": torch.randn(4, dtype=torch.float16),
        "c.weight": torch.randn(2, 3, dtype=torch.float32).t(),  # not contiguous
        "empty": torch.zeros(0, 3),
    }
    update_info = make_update_info(weights.items(), "b64")
    assert all(isinstance(e["data_b64"], str) for e in update_info["weights"])  # JSON-safe
    got = _received(backend, update_info)
    for name, tensor in weights.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name], tensor)


def test_tensor_and_numpy_forms(backend):
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    arr.flags.writeable = False  # as when it arrives in a ZMQ frame
    got = _received(backend, {"weights": {"x": arr, "y": torch.ones(2)}})
    assert got["x"].dtype == torch.float32 and got["x"].tolist() == arr.tolist()
    assert torch.equal(got["y"], torch.ones(2))


@pytest.mark.parametrize(
    "update_info,message",
    [
        ({}, r"update_info.weights: missing"),
        ({"weights": {}, "extra": 1}, r"unknown field\(s\) \['extra'\]"),
        ({"weights": "nope"}, "update_info.weights: expected"),
        ({"weights": {"x": [1.0, 2.0]}}, r"update_info.weights\['x'\]: expected a torch.Tensor or numpy.ndarray"),
        ({"weights": [{"name": "x", "dtype": "float32", "shape": [2]}]}, r"missing field\(s\) \['data_b64'\]"),
        ({"weights": [{"name": "x", "dtype": "floaty", "shape": [2], "data_b64": ""}]}, "'floaty' is not a torch dtype"),
        ({"weights": [{"name": "x", "dtype": "float32", "shape": [-1], "data_b64": ""}]},
         r"update_info\.weights\[0\]\.shape\[0\]: -1 is below 0"),
        ({"weights": [{"name": "x", "dtype": "float32", "shape": [2], "data_b64": "@@@"}]}, "not valid base64"),
        (
            {"weights": [{"name": "x", "dtype": "float32", "shape": [3], "data_b64": base64.b64encode(b"\0" * 8).decode()}]},
            r"8 bytes, but shape \[3\] of float32 needs 12",
        ),
        ({"weights": [{"name": "", "dtype": "float32", "shape": [0], "data_b64": ""}]},
         r"update_info\.weights\[0\]\.name: '' is not a non-empty string"),
        ({"weights": {"": torch.ones(1)}}, r"update_info\.weights \(a key\): '' is not a non-empty string"),
        ({"weights": [{"name": "x", "dtype": "float32", "shape": [2**63], "data_b64": ""}]},
         r"update_info\.weights\[0\]\.shape\[0\]: 9223372036854775808 is out of range \(must be <= 2\*\*63 - 1\)"),
    ],
)
def test_bad_update_info_names_the_field(backend, update_info, message):
    with pytest.raises(ValueError, match=message):
        backend.parse_update_info(update_info)


class _RecordingClient:
    """A weight-sync client of one engine that records its calls and refuses the one named `refuse`."""

    def __init__(self, refuse: str | None = None) -> None:
        self.calls: list[str] = []
        self.refuse = refuse

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.refuse:
            raise RuntimeError(f"{name} refused")

    def init_weight_transfer_engine(self, init_info):
        self._call("init")

    def start_weight_update(self):
        self._call("start")

    def update_weights(self, update_info):
        self._call("update")

    def finish_weight_update(self, weight_version=None):
        self._call("finish")

    def abort_weight_update(self):
        self._call("abort")


@pytest.mark.parametrize(
    "refuse,calls",
    [
        (None, ["start", "update", "finish"]),
        ("update", ["start", "update", "abort"]),
        ("finish", ["start", "update", "finish", "abort"]),
        ("start", ["start"]),  # nothing of ours began (it may be another trainer's update): nothing to abort
    ],
)
def test_send_weights_runs_the_update_lifecycle_and_aborts_what_it_began(refuse, calls):
    client = _RecordingClient(refuse)
    trainer = trainer_init({"backend": "local"}, client=client, source=StateDictSource({"w": torch.ones(4)}))
    assert client.calls == ["init"]
    client.calls.clear()
    if refuse is None:
        stats = trainer.send_weights(weight_version="v1")
        assert (stats.weight_version, stats.num_tensors, stats.bytes_sent) == ("v1", 1, 16)
    else:
        with pytest.raises(RuntimeError, match=f"{refuse} refused"):
            trainer.send_weights(weight_version="v1")
    assert client.calls == calls


class _RecordingSyncClient(WeightSyncClient):
    """A WeightSyncClient of one engine that records the controls it calls and refuses the one named `refuse`."""

    def __init__(self, refuse: str | None = None) -> None:
        self.calls: list[str] = []
        self.refuse = refuse

    def _call(self, method: str, *args):
        self.calls.append(method)
        if method == self.refuse:
            raise RuntimeError(f"{method} refused")


@pytest.mark.parametrize(
    "max_bytes,refuse,calls",
    [
        (1 << 20, None, ["apply_weight_update"]),  # fits one call: the whole update in one round trip
        (1 << 20, "apply_weight_update", ["apply_weight_update", "abort_weight_update"]),  # it may hold it (timeout)
        (16, None, ["start_weight_update", "update_weights", "update_weights", "finish_weight_update"]),
    ],
)
def test_a_sync_that_fits_one_call_is_one_engine_call(max_bytes, refuse, calls):
    client = _RecordingSyncClient(refuse)
    trainer = trainer_init({"backend": "local", "max_bytes_per_call": max_bytes}, client=client,
                           source=StateDictSource({"a": torch.ones(4), "b": torch.zeros(4)}))
    client.calls.clear()
    if refuse is None:
        stats = trainer.send_weights(weight_version="v1")
        assert (stats.weight_version, stats.num_tensors, stats.bytes_sent) == ("v1", 2, 32)
    else:
        with pytest.raises(RuntimeError, match=f"{refuse} refused"):
            trainer.send_weights(weight_version="v1")
    assert client.calls == calls


def test_trainer_settings_are_checked_however_they_are_made():
    with pytest.raises(ValueError, match=r"init_info\.max_bytes_per_call: 0 is below 1"):
        LocalTrainerInitInfo(max_bytes_per_call=0)
    with pytest.raises(ValueError, match=r"init_info\.encoding: expected 'tensors' or 'b64', got 'base64'"):
        trainer_init({"backend": "local", "encoding": "base64"}, client=_RecordingClient())
    with pytest.raises(ValueError, match=r"init_info: unknown field\(s\) \['bogus'\]"):
        trainer_init({"backend": "local", "bogus": 1}, client=_RecordingClient())
    with pytest.raises(ValueError, match=r"init_info\.max_bytes_per_call: expected `int`, got `bool`"):
        trainer_init({"backend": "local", "max_bytes_per_call": True}, client=_RecordingClient())


def test_registry_is_lazy_and_lists_known_backends(monkeypatch):
    import weight_transfer.base

    monkeypatch.setattr(weight_transfer.base, "_ENGINE_BACKENDS", dict(weight_transfer.base._ENGINE_BACKENDS))
    assert get_engine_backend("local") is LocalWeightTransferEngine
    with pytest.raises(ValueError, match=r"unknown weight transfer backend 'zzz'; known: \[.*'local'.*\]"):
        get_engine_backend("zzz")
    with pytest.raises(ValueError, match="package.module:ClassName"):
        register_engine_backend("bad", "no_colon_here")

    class Custom(LocalWeightTransferEngine):
        pass

    register_engine_backend("custom-test", Custom)
    assert get_engine_backend("custom-test") is Custom
    register_engine_backend("custom-lazy-test", "weight_transfer.local:LocalWeightTransferEngine")
    assert issubclass(get_engine_backend("custom-lazy-test"), WeightTransferEngine)
    register_engine_backend("custom-wrong-test", "weight_transfer.local:make_update_info")
    with pytest.raises(TypeError, match="not a WeightTransferEngine"):
        get_engine_backend("custom-wrong-test")


def test_checksums_are_exact_and_layout_independent():
    t = torch.randn(4, 6)
    assert tensor_checksum(t.t()) == tensor_checksum(t.t().contiguous())
    assert tensor_checksum(t) != tensor_checksum(t.reshape(6, 4))  # the shape is part of it
    bumped = t.clone()
    bumped[2, 3] = torch.nextafter(bumped[2, 3], torch.tensor(1e9))
    assert tensor_checksum(bumped) != tensor_checksum(t)
    # A float32 trainer computes a bfloat16 engine's checksums by casting first.
    assert tensor_checksum(t, dtype=torch.bfloat16) == tensor_checksum(t.to(torch.bfloat16))
    sums = hf_state_checksums({"w": t, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)})
    assert list(sums) == ["w"]


def test_compare_checksums():
    engine = {"a": "1", "b": "2", "lm_head.weight": "1"}
    assert compare_checksums(engine, {"a": "1", "b": "2"}, optional=["lm_head.weight"])["match"]
    result = compare_checksums(engine, {"a": "1", "b": "3", "c": "4"})
    assert result == {"match": False, "mismatches": ["b"], "missing": ["lm_head.weight"], "unexpected": ["c"]}
    with pytest.raises(ValueError, match="baseline"):
        compare_checksums(engine, ["a"])


def test_encode_weights_b64_is_little_endian_raw_bytes():
    [entry] = encode_weights_b64([("w", torch.tensor([1.0, -2.0]))])
    assert base64.b64decode(entry["data_b64"]) == np.array([1.0, -2.0], dtype="<f4").tobytes()
    assert entry["dtype"] == "float32" and entry["shape"] == [2]


def test_output_processor_spans_per_output_kind():
    from engine.output_processor import OutputProcessor
    from engine.sampling_params import RequestOutputKind, SamplingParams
    from engine.wire import EngineCoreOutput, EngineCoreRequest

    proc = OutputProcessor(None)
    for req_id, kind in [("c", RequestOutputKind.CUMULATIVE), ("d", RequestOutputKind.DELTA)]:
        params = SamplingParams(max_tokens=9, detokenize=False, output_kind=kind)
        proc.add_request(EngineCoreRequest(req_id, [1, 2], params, eos_token_id=None), None)

    def step(tokens, version):
        outs = proc.process_outputs([EngineCoreOutput(r, tokens) for r in ("c", "d")], version)
        return {o.request_id: o.outputs[0] for o in outs.request_outputs}

    assert step([5, 6], None)["d"].weight_versions == [("default", 0, 2)]  # no version: "default"
    assert step([7], "default")["c"].weight_versions == [("default", 0, 3)]  # same version: one span
    out = step([8, 9, 10], "v2")
    assert out["c"].weight_versions == [("default", 0, 3), ("v2", 3, 6)]
    assert out["d"].weight_versions == [("v2", 0, 3)]  # a delta's spans index its own token_ids
    out = step([11], "v3")
    assert out["c"].weight_versions == [("default", 0, 3), ("v2", 3, 6), ("v3", 6, 7)]
    assert out["d"].token_ids == [11] and out["d"].weight_versions == [("v3", 0, 1)]

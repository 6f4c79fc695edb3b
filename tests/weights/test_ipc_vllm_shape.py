"""vLLM's shape of the ipc backend on CPU: update_info parsed and checked, ipc_handles_pickled refused without
the operator's flag and, with it, read only through the allow-list - everything short of mapping CUDA memory.

The engine side here is the real IPCWeightTransferEngine (on a CPU worker, so a well-formed vLLM call ends at
"this worker runs on cpu": everything before that point ran). The same over HTTP against `rollout launch`:
tests/weights/test_ipc_vllm_http.py; against vLLM's own dataclasses: tests/compat/test_vllm_ipc_wire.py.
"""

from __future__ import annotations

import base64
import os
import pickle

import pytest
import torch

from weight_transfer import ipc_vllm
from weight_transfer.ipc import IPCTrainerInitInfo, IPCWeightTransferEngine

FLAG = "--weight-transfer-allow-pickled-ipc-handles"
UUID = "GPU-3b4c5d6e-0000-1111-2222-333344445555"


def rebuild_args(dtype=torch.bfloat16, shape=(4, 8), *, tensor_cls=torch.Tensor, storage_cls=torch.storage.TypedStorage,
                 storage_bytes=None, offset=0) -> tuple:
    """rebuild_cuda_tensor's 15 arguments as torch's reduce_tensor lays them out (the handles are made-up bytes)."""
    size = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    nbytes = size.numel() * dtype.itemsize if storage_bytes is None else storage_bytes
    return (tensor_cls, size, stride, offset, storage_cls, dtype, 0, b"\x11" * 64, nbytes, 0, False,
            b"/torch_1234_5678_0", 0, b"\x22" * 64, True)


def pickled(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def unpacked_call(names=("model.embed_tokens.weight",), shapes=((4, 8),), dtype=torch.bfloat16, **fields) -> dict:
    handles = [{UUID: rebuild_args(dtype, s)} for s in shapes]
    return {"names": list(names), "dtype_names": [str(dtype).removeprefix("torch.")] * len(names),
            "shapes": [list(s) for s in shapes], "ipc_handles_pickled": pickled(handles), **fields}


def engine(packed=False, allow=False) -> IPCWeightTransferEngine:
    e = IPCWeightTransferEngine(torch.device("cpu"))
    e.allow_pickled_ipc_handles = allow
    init = e.parse_init_info({"packed": packed})
    e.init_transfer(init)
    return e


CPU_END = "this worker runs on cpu"  # where a well-formed vLLM call stops on a CPU worker


# ---- init_info ---------------------------------------------------------------------------------


def test_vllm_init_info_is_recognised_and_ours_still_parses_as_ours():
    e = IPCWeightTransferEngine(torch.device("cpu"))
    assert isinstance(e.parse_init_info({}), ipc_vllm.VLLMIPCInitInfo)  # vLLM's default: packed False
    assert e.parse_init_info({"packed": True, "backend": "ipc"}).packed is True
    with pytest.raises(ValueError, match=r"init_info.packed: expected `bool`"):
        e.parse_init_info({"packed": "yes"})
    with pytest.raises(ValueError, match=r"init_info.control"):  # our shape keeps its own errors
        e.parse_init_info({"backend": "ipc", "control": "nope", "host": "x", "timeout_s": 1.0, "keep_buffers": True})


# ---- the opt-in ----------------------------------------------------------------------------------


def test_pickled_handles_are_refused_without_the_flag_naming_field_and_flag():
    with pytest.raises(ValueError) as e:
        engine().parse_update_info(unpacked_call())
    message = str(e.value)
    assert message.startswith("update_info.ipc_handles_pickled:")
    assert FLAG in message and "VLLM_ALLOW_INSECURE_SERIALIZATION" in message


def test_pickles_are_never_even_decoded_without_the_flag(tmp_path):
    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with pytest.raises(ValueError, match=FLAG):
        engine().parse_update_info({**unpacked_call(), "ipc_handles_pickled": pickled([{UUID: Hostile()}])})
    assert not marker.exists()


def test_a_well_formed_pickle_is_admitted_up_to_the_point_where_cuda_is_needed():
    with pytest.raises(ValueError, match=CPU_END):
        engine(allow=True).parse_update_info(unpacked_call(names=("a", "b"), shapes=((4, 8), (3,))))
    # ... and the same objects from an in-process caller (no pickle at all) take the same path.
    call = unpacked_call()
    call["ipc_handles"] = [{UUID: rebuild_args()}]
    del call["ipc_handles_pickled"]
    with pytest.raises(ValueError, match=CPU_END):
        engine().parse_update_info(call)


class _Reduce:
    """An object that pickles as fn(*args)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _hostile_payloads(marker):
    args = list(rebuild_args())
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    yield "os.system", [{UUID: _Reduce(os.system, f"touch {marker}")}], "posix.system"
    yield "eval", [{UUID: _Reduce(eval, f"open({str(marker)!r}, 'w')")}], "builtins.eval"
    # A reduce nested inside an allowed call: torch.Size(os.system(...)).
    yield "nested", [{UUID: tuple([args[0], _Reduce(torch.Size, _Reduce(os.system, f"touch {marker}"))] + args[2:])}], \
        "posix.system"
    # A wrong function where rebuild_cuda_tensor's tensor class goes, and the rebuild call itself shipped.
    yield "wrong class", [{UUID: tuple([exec] + args[1:])}], "builtins.exec"
    yield "rebuild call", [{UUID: _Reduce(rebuild_cuda_tensor, *args)}], "rebuild_cuda_tensor"
    # An allowed class called by the pickle (a storage of a terabyte): admitted classes are never callable.
    yield "storage call", [{UUID: _Reduce(torch.storage.TypedStorage, 1 << 40)}], "not a readable pickle"


@pytest.mark.parametrize("case", ["os.system", "eval", "nested", "wrong class", "rebuild call", "storage call"])
def test_hostile_pickles_are_refused_with_the_flag_and_nothing_runs(case, tmp_path):
    marker = tmp_path / "ran"
    [(payload, expected)] = [(p, x) for name, p, x in _hostile_payloads(marker) if name == case]
    with pytest.raises(ValueError) as e:
        engine(allow=True).parse_update_info({**unpacked_call(), "ipc_handles_pickled": pickled(payload)})
    assert str(e.value).startswith("update_info.ipc_handles_pickled:")
    assert expected in str(e.value)
    assert not marker.exists()


def test_an_allowed_global_in_the_wrong_slot_is_refused_naming_the_slot():
    args = list(rebuild_args())
    args[0] = torch.Size  # an admitted global, but not a tensor class
    with pytest.raises(ValueError, match=r"update_info.ipc_handles\[0\]\['GPU-.*'\]\[0\] \(tensor class\)"):
        engine(allow=True).parse_update_info({**unpacked_call(), "ipc_handles_pickled": pickled([{UUID: tuple(args)}])})


def test_a_build_opcode_is_refused_before_unpickling():
    # [torch.Size] then BUILD with a state dict: would set attributes on the stand-in the allow-list hands back.
    raw = b"\x80\x04]" + b"\x8c\x05torch\x8c\x04Size\x93" + b"}\x8c\x01x\x88sb" + b"a."
    with pytest.raises(ValueError, match="refused pickle opcode BUILD"):
        engine(allow=True).parse_update_info({**unpacked_call(), "ipc_handles_pickled": base64.b64encode(raw).decode()})


def test_garbage_is_a_clear_error():
    e = engine(allow=True)
    with pytest.raises(ValueError, match="ipc_handles_pickled: not valid base64"):
        e.parse_update_info({**unpacked_call(), "ipc_handles_pickled": "%%%"})
    with pytest.raises(ValueError, match="ipc_handles_pickled: not a readable pickle"):
        e.parse_update_info({**unpacked_call(), "ipc_handles_pickled": base64.b64encode(b"\x80\x04]\x8c").decode()})


# ---- the fields, checked before anything is mapped ----------------------------------------------------


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c.update(dtype_names=["bfloat16", "float32"]), r"update_info.dtype_names: 2 entries for 1 names"),
    (lambda c: c.update(shapes=[]), r"update_info.shapes: 0 entries for 1 names"),
    (lambda c: c.update(dtype_names=["bfloat17"]), r"update_info.dtype_names\[0\]: 'bfloat17' is not a torch dtype"),
    (lambda c: c.update(ipc_handles=[{}]), r"give ipc_handles or ipc_handles_pickled, not both"),
    (lambda c: c.pop("ipc_handles_pickled"), r"update_info.ipc_handles: missing"),
    (lambda c: c.update(dtypes=["bfloat16"]), r"update_info: unknown field\(s\) \['dtypes'\]"),
    (lambda c: c.update(ipc_handles_pickled=pickled([{UUID: rebuild_args(torch.float32)}])),
     r"ipc_handles\[0\]\['GPU-.*'\]: a torch.float32 \[4, 8\] tensor for 'model.embed_tokens.weight', "
     r"announced as bfloat16"),
    (lambda c: c.update(ipc_handles_pickled=pickled([{UUID: rebuild_args(storage_bytes=10)}])),
     r"\[8\] \(storage_size_bytes\): the tensor reaches byte 64, beyond the storage's 10"),
    (lambda c: c.update(ipc_handles_pickled=pickled([{UUID: rebuild_args()[:14]}])),
     r"ipc_handles\[0\]\['GPU-.*'\]: expected rebuild_cuda_tensor's 15 arguments"),
    (lambda c: c.update(ipc_handles_pickled=pickled([{UUID: rebuild_args()}] * 2)),
     r"ipc_handles: 2 entries for 1 names"),
    (lambda c: c.update(ipc_handles_pickled=pickled({UUID: rebuild_args()})), r"ipc_handles: expected a list"),
])
def test_bad_unpacked_fields_are_refused_naming_the_field(change, message):
    call = unpacked_call()
    change(call)
    with pytest.raises(ValueError, match=message):
        engine(allow=True).parse_update_info(call)


def test_json_handles_over_http_are_refused_naming_the_slot():
    # What a JSON body can hold: the classes become strings. vLLM never sends this; the error says what is wrong.
    call = unpacked_call()
    del call["ipc_handles_pickled"]
    call["ipc_handles"] = [{UUID: ["torch.Tensor", [4, 8], [8, 1], 0, "TypedStorage", "bfloat16", 0, "x", 64, 0,
                                   False, "y", 0, "z", True]}]
    with pytest.raises(ValueError, match=r"ipc_handles\[0\]\['GPU-.*'\]\[0\] \(tensor class\): expected one of"):
        engine().parse_update_info(call)


def packed_call(sizes=None, buffer_bytes=1024, **fields) -> dict:
    names, shapes, dtypes = ["a", "b"], [[4, 8], [3]], ["bfloat16", "float32"]
    sizes = [64, 12] if sizes is None else sizes
    buffer = {UUID: rebuild_args(torch.uint8, (buffer_bytes,))}
    return {"names": names, "dtype_names": dtypes, "shapes": shapes, "ipc_handles_pickled": pickled(buffer),
            "tensor_sizes": sizes, **fields}


def test_packed_calls_are_checked_against_the_buffer():
    e = engine(packed=True, allow=True)
    with pytest.raises(ValueError, match=CPU_END):
        e.parse_update_info(packed_call())
    with pytest.raises(ValueError, match=r"update_info.tensor_sizes\[1\]: 13 bytes, but 'b' \(float32 \[3\]\) has 12"):
        e.parse_update_info(packed_call(sizes=[64, 13]))
    with pytest.raises(ValueError, match=r"update_info.tensor_sizes: 76 bytes in all, beyond the buffer's 70"):
        e.parse_update_info(packed_call(buffer_bytes=70))
    with pytest.raises(ValueError, match=r"update_info.tensor_sizes: missing"):
        e.parse_update_info({k: v for k, v in packed_call().items() if k != "tensor_sizes"})
    with pytest.raises(ValueError, match=r"a packed buffer is 1-D uint8, not torch.bfloat16"):
        e.parse_update_info(packed_call(ipc_handles_pickled=pickled({UUID: rebuild_args()})))
    with pytest.raises(ValueError, match=r"ipc_handles: expected a dict of GPU uuid"):
        e.parse_update_info(packed_call(ipc_handles_pickled=pickled([{UUID: rebuild_args(torch.uint8, (1024,))}])))


# ---- the trainer side ----------------------------------------------------------------------------------


def test_the_vllm_wire_needs_cuda():
    with pytest.raises(ValueError, match=r"init_info.wire: vLLM's ipc shape \('vllm'\) shares CUDA tensors"):
        IPCTrainerInitInfo(wire="vllm", device="cpu")
    with pytest.raises(ValueError, match="vLLM's ipc shape shares CUDA tensors, not cpu ones"):
        ipc_vllm.share(torch.zeros(3))


def test_our_vllm_shaped_update_info_round_trips_through_our_parser():
    handles = [{UUID: rebuild_args(torch.float32, (2, 3))}]
    for is_pickled in (True, False):
        info = ipc_vllm.update_info(["w"], [torch.float32], [[2, 3]], handles, pickled=is_pickled)
        assert sorted(info) == sorted(["names", "dtype_names", "shapes",
                                       "ipc_handles_pickled" if is_pickled else "ipc_handles"])
        with pytest.raises(ValueError, match=CPU_END):
            engine(allow=True).parse_update_info(info)


def test_vllms_tensor_list_reads_as_ours_does():
    # The same tensors announced both ways: vLLM's names / dtype_names / shapes and our names / dtypes / shapes.
    from weight_transfer import packing
    from weight_transfer.messages import parse_message

    names, dtypes, shapes = ["a", "b"], [torch.bfloat16, torch.float32], [(4, 8), (3,)]
    handles = [{UUID: rebuild_args(d, s)} for d, s in zip(dtypes, shapes)]
    theirs = parse_message(ipc_vllm.update_info(names, dtypes, shapes, handles, pickled=False),
                           ipc_vllm.VLLMIPCUpdateInfo, "update_info")
    ours = parse_message(packing.tensor_list(names, dtypes, shapes), packing.TensorList, "update_info")
    assert (theirs.names, theirs.dtype_names, theirs.shapes) == (ours.names, ours.dtypes, ours.shapes)
    checked = ipc_vllm.check_handles(theirs, theirs.ipc_handles, packed=False)
    assert [c[UUID].args[:6] for c in checked] == [h[UUID][:6] for h in handles]


def test_an_error_about_a_huge_or_deeply_nested_value_stays_short():
    nested: list = []
    for _ in range(50_000):  # deeper than repr could go
        nested = [nested]
    for handles in (nested, [list(range(1_000_000))], [{UUID: tuple(range(15))}]):
        call = {**unpacked_call(), "ipc_handles": handles}
        del call["ipc_handles_pickled"]
        with pytest.raises(ValueError, match=r"^update_info.ipc_handles\[0\]") as e:
            engine().parse_update_info(call)
        assert len(str(e.value)) < 400

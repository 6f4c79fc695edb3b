"""vLLM's ipc shape over HTTP against a real `rollout launch` (CPU): ipc_handles_pickled is a 400 naming the field
and the flag unless the server was started with --weight-transfer-allow-pickled-ipc-handles; with it, hostile
pickles are a 400 naming what was refused, a well-formed one gets as far as needing CUDA, and no weight changes.

The update_info dicts are the ones vLLM's trainer builds (IPCTrainerWeightTransferEngine._do_send and its HTTP
client's _json_safe_update_info): names, dtype_names, shapes, ipc_handles pickled into ipc_handles_pickled.
"""

from __future__ import annotations

import base64
import os
import pickle

import httpx
import pytest
import torch
from test_ipc_vllm_shape import UUID, rebuild_args
from weight_helpers import hf_model

from weight_transfer.checksums import hf_state_checksums

FLAG = "--weight-transfer-allow-pickled-ipc-handles"
NAME = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def servers(launch_server, checkpoint):
    """{"default": a server without the flag, "allowed": one with it}; both pick ipc for an init_info naming no
    backend, as a vLLM server started with --weight-transfer-config '{"backend": "ipc"}' does."""
    args = ("--enable-rl-routes", "--weight-transfer-config", '{"backend": "ipc"}')
    return {"default": launch_server(checkpoint, *args), "allowed": launch_server(checkpoint, *args, FLAG)}


@pytest.fixture(scope="module")
def baseline(checkpoint):
    """The checkpoint's checksums (what the servers serve, before and after every refused update), and its
    embedding's shape."""
    state = hf_model(checkpoint).state_dict()
    return hf_state_checksums(state), tuple(state[NAME].shape)


def _serves(url: str, baseline) -> bool:
    with httpx.Client(base_url=url, timeout=60) as http:
        return http.post("/weight_checker", json={"baseline": baseline[0]}).json()["match"]


def _vllm_call(baseline, handles=None) -> dict:
    """The update_info vLLM's trainer sends over HTTP for one tensor, the embedding (float32: --dtype float32)."""
    dtype, shape = torch.float32, list(baseline[1])
    if handles is None:
        handles = [{UUID: rebuild_args(dtype, tuple(shape))}]
    return {"names": [NAME], "dtype_names": [str(dtype).removeprefix("torch.")], "shapes": [shape],
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}


def _update(url: str, update_info: dict) -> httpx.Response:
    """init (vLLM's {"packed": false}), start, one update_weights, abort: the update's answer."""
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.post("/init_weight_transfer_engine", json={"init_info": {"packed": False}}).status_code == 200
        assert http.post("/start_weight_update").status_code == 200
        try:
            return http.post("/update_weights", json={"update_info": update_info})
        finally:
            http.post("/abort_weight_update")


def _error(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["message"]


def test_pickled_handles_are_a_400_naming_the_field_and_the_flag_without_it(servers, baseline):
    url = servers["default"].url
    message = _error(_update(url, _vllm_call(baseline)))
    assert "update_info.ipc_handles_pickled" in message and FLAG in message
    assert _serves(url, baseline)


class _Reduce:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def test_with_the_flag_hostile_pickles_are_refused_and_nothing_runs(servers, baseline, tmp_path):
    url = servers["allowed"].url
    marker = tmp_path / "ran"
    for payload, refused in [
        ([{UUID: _Reduce(os.system, f"touch {marker}")}], "posix.system"),
        ([{UUID: _Reduce(eval, f"open({str(marker)!r}, 'w')")}], "builtins.eval"),
        ([{UUID: tuple([exec, *rebuild_args()[1:]])}], "builtins.exec"),
    ]:
        message = _error(_update(url, _vllm_call(baseline, payload)))
        assert "update_info.ipc_handles_pickled" in message and refused in message
    assert not marker.exists()
    assert _serves(url, baseline)


def test_with_the_flag_a_well_formed_pickle_gets_as_far_as_needing_cuda(servers, baseline):
    url = servers["allowed"].url
    message = _error(_update(url, _vllm_call(baseline)))
    assert "this worker runs on cpu" in message
    assert _serves(url, baseline)

"""vLLM 0.33's own RL client code against a real `rollout launch --enable-rl-routes` process on loopback.

- vLLM's HTTPVLLMWeightSyncClient (vllm.distributed.weight_transfer.clients) drives the whole weight
  lifecycle - init, start, update, finish(version), shutdown - with our CPU-capable "local" backend
  behind it (its init_info and update_info pass through vLLM's client unchanged); the new weights
  serve under the version and match the trainer's checksums.
- vLLM's request dataclasses (WeightTransferInitRequest / WeightTransferUpdateRequest) are taken by our
  Python API as they are, as vLLM's own LLM and AsyncLLM take them.
"""

from __future__ import annotations

import os

import httpx
import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_clients(vllm_import):
    return vllm_import("vllm.distributed.weight_transfer.clients")


@pytest.fixture(scope="module")
def vllm_base(vllm_import):
    return vllm_import("vllm.distributed.weight_transfer.base")


def test_vllm_http_weight_sync_client_drives_the_lifecycle(vllm_clients, launch_server, tiny_checkpoint):
    from weight_transfer import hf_state_checksums
    from weight_transfer.local import make_update_info

    server = launch_server(tiny_checkpoint("llama"), "--enable-rl-routes")
    new = load_file(os.path.join(tiny_checkpoint("llama", seed=1), "model.safetensors"))
    client = vllm_clients.HTTPVLLMWeightSyncClient(server.url, timeout=120)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.post("/weight_checker", json={"baseline": hf_state_checksums(new)}).json()["match"] is False
        # vLLM's client raises (raise_for_status) on any status >= 400: each call returning is each route's 200.
        assert http.post("/pause", params={"mode": "wait"}).json() == {"status": "paused"}
        client.init_weight_transfer_engine({"backend": "local"})
        client.start_weight_update()
        client.update_weights(make_update_info(new.items(), encoding="b64"))
        client.finish_weight_update("step-1")
        client.shutdown_weight_transfer_engine()
        assert http.post("/resume").json() == {"status": "resumed"}
        assert http.get("/weight_info").json()["weight_version"] == "step-1"
        assert http.post("/weight_checker", json={"baseline": hf_state_checksums(new)}).json()["match"] is True
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        # finish without a version (vLLM's client sends no body then) keeps the version
        client.init_weight_transfer_engine({"backend": "local"})
        client.start_weight_update()
        client.finish_weight_update()
        assert http.get("/weight_info").json()["weight_version"] == "step-1"
        # A refusal reaches vLLM's client as its HTTPError: the update routes without a start are a 400.
        import requests

        with pytest.raises(requests.HTTPError):
            client.update_weights(make_update_info(new.items(), encoding="b64"))
    server.stop()


def test_vllm_request_dataclasses_are_taken_by_our_python_api(vllm_base, tiny_checkpoint):
    from engine.llm import LLM
    from weight_transfer import hf_state_checksums
    from weight_transfer.local import make_update_info

    new = load_file(os.path.join(tiny_checkpoint("llama", seed=1), "model.safetensors"))
    with LLM(tiny_checkpoint("llama"), device="cpu") as llm:
        llm.init_weight_transfer_engine(vllm_base.WeightTransferInitRequest(init_info={"backend": "local"}))
        llm.start_weight_update()
        llm.update_weights(vllm_base.WeightTransferUpdateRequest(update_info=make_update_info(new.items(), "b64")))
        llm.finish_weight_update("v-dataclass")
        assert llm.get_weight_version() == "v-dataclass"
        assert llm.weight_checker(hf_state_checksums(new))["match"] is True
        # {"init_info": ...} / {"update_info": ...}, as vLLM's offline LLM takes dicts
        llm.init_weight_transfer_engine({"init_info": {"backend": "local"}})
        llm.start_weight_update()
        llm.update_weights({"update_info": make_update_info(new.items(), "b64")})
        llm.finish_weight_update()
        with pytest.raises(ValueError, match="init_info"):
            llm.init_weight_transfer_engine(vllm_base.WeightTransferInitRequest(init_info=["backend"]))

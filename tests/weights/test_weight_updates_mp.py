"""Weight updates over a real EngineCore process: the lifecycle via call_utility, numpy arrays as ZMQ frames."""

from __future__ import annotations

import numpy as np
import pytest
from weight_helpers import MAX_TOKENS, PROMPTS, hf_greedy, hf_model, read_state

from engine.core_client import EngineUtilityError
from engine.engine_args import create_engine_config
from engine.mp_client import SyncMPClient
from engine.sampling_params import SamplingParams
from engine.wire import EngineCoreRequest
from weight_transfer.checksums import hf_state_checksums
from weight_transfer.local import make_update_info

pytestmark = pytest.mark.slow


def _generate(client, prefix: str) -> tuple[list[list[int]], set[str]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    req_ids = [f"{prefix}{i}" for i in range(len(PROMPTS))]
    for req_id, prompt in zip(req_ids, PROMPTS):
        client.add_request(EngineCoreRequest(req_id, prompt, params, eos_token_id=None))
    tokens = {r: [] for r in req_ids}
    versions, done = set(), set()
    while len(done) < len(req_ids):
        outputs = client.get_output()
        for out in outputs.outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.new_token_ids:
                versions.add(outputs.weight_version)
            if out.finished:
                done.add(out.request_id)
    return [tokens[r] for r in req_ids], versions


def test_lifecycle_over_zmq_with_numpy_frames(checkpoints):
    old, new = checkpoints("qwen3")
    config = create_engine_config(model=old, max_model_len=64, device="cpu", dtype="float32", max_num_seqs=8)
    client = SyncMPClient(config)
    try:
        new_state = read_state(new)
        baseline = hf_state_checksums(new_state)
        assert client.call_utility("weight_checker", baseline)["match"] is False

        client.call_utility("init_weight_transfer_engine", {"backend": "local"})
        client.call_utility("start_weight_update")
        with pytest.raises(EngineUtilityError, match="WeightUpdateStateError: start_weight_update: a weight update is already"):
            client.call_utility("start_weight_update")
        arrays = {name: t.numpy() for name, t in new_state.items()}  # large ones travel as their own frames
        bad = dict(arrays, **{"model.norm.weight": np.full(64, np.nan, np.float32)})
        with pytest.raises(EngineUtilityError, match="ValueError: .*'model.norm.weight': contains NaN or inf"):
            client.call_utility("update_weights", {"weights": bad})
        assert client.call_utility("weight_checker", hf_state_checksums(read_state(old)))["match"]
        assert client.call_utility("update_weights", {"weights": arrays}) == len(arrays)
        client.call_utility("finish_weight_update", "v1")

        assert client.call_utility("get_weight_version") == "v1"
        checked = client.call_utility("weight_checker", baseline)
        assert checked["match"] is True and checked["weight_version"] == "v1"
        tokens, versions = _generate(client, "a")
        assert tokens == hf_greedy(hf_model(new)) and versions == {"v1"}

        # The HTTP-safe base64 form over the same socket, back to the old weights.
        client.call_utility("start_weight_update")
        client.call_utility("update_weights", make_update_info(read_state(old).items(), "b64"))
        client.call_utility("finish_weight_update", "v2")
        tokens, versions = _generate(client, "b")
        assert tokens == hf_greedy(hf_model(old)) and versions == {"v2"}
        client.call_utility("shutdown_weight_transfer_engine")
    finally:
        client.shutdown()

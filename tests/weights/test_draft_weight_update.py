"""Weight updates of speculative decoding's draft model: init_info / update_info "model": "draft".

The tiny checkpoint is its own draft, so with greedy decoding every draft is accepted; other
weights pushed into the draft alone lower acceptance but never change a token, and the draft's
KV never serves stale: pushing the old weights back brings every acceptance back.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.exceptions import WeightTransferError
from engine.wire import EngineCoreRequest
from weight_transfer.base import register_engine_backend
from weight_transfer.checksums import hf_state_checksums
from weight_transfer.local import LocalWeightTransferEngine, make_update_info

from weight_helpers import read_state

_RNG = random.Random(0)
# 20 to 60 tokens: full blocks of 16 that a second run would hit in the prefix cache.
PROMPTS = [[_RNG.randrange(3, 400) for _ in range(_RNG.randint(20, 60))] for _ in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _llm(path, draft=None, **kwargs) -> LLM:
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3} if draft else None
    return LLM(path, dtype="float32", device="cpu", max_model_len=128, block_size=16, enable_prefix_caching=True,
               speculative_config=spec, **kwargs)


def _tokens(llm, prompts=PROMPTS) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _acceptance(core) -> tuple[int, int]:
    """(draft tokens, accepted tokens) so far."""
    totals = core.scheduler.spec_totals
    return totals.num_draft_tokens, totals.num_accepted_tokens


def _generate_counting(llm, prompts=PROMPTS) -> tuple[list[list[int]], int, int]:
    """Greedy tokens, and the draft tokens proposed and accepted while making them."""
    drafted, accepted = _acceptance(llm.engine_core)
    tokens = _tokens(llm, prompts)
    now_drafted, now_accepted = _acceptance(llm.engine_core)
    return tokens, now_drafted - drafted, now_accepted - accepted


def _update(core, state: dict, model: str | None = None, version: str | None = None) -> None:
    """One whole update of `model` (None: the default, the target) with the local backend."""
    selector = {} if model is None else {"model": model}
    core.start_weight_update()
    assert core.update_weights({**make_update_info(state.items()), **selector}) == len(state)
    core.finish_weight_update(weight_version=version)


@pytest.fixture(scope="module")
def states(checkpoints):
    old, new = checkpoints("llama")
    return old, read_state(old), read_state(new)


@pytest.fixture(scope="module")
def expected(states):
    """Greedy tokens of the seed-0 model without speculation."""
    plain = _llm(states[0])
    tokens = _tokens(plain)
    plain.engine_core.shutdown()
    return tokens


def test_draft_update_changes_acceptance_never_the_outputs(states, expected):
    path, old_state, new_state = states
    llm = _llm(path, draft=path)
    core = llm.engine_core
    tokens, drafted, accepted = _generate_counting(llm, PROMPTS[:3])
    assert tokens == expected[:3]
    assert drafted > 0 and accepted == drafted  # the model as its own draft: every greedy draft is right
    target_sums = core.weight_checker()["checksums"]
    assert core.weight_checker(model="draft")["checksums"] == target_sums  # the same checkpoint
    assert core.weight_info(model="draft")["weights"] == core.weight_info()["weights"]

    core.init_weight_transfer_engine({"backend": "local", "model": "draft"})
    _update(core, new_state, model="draft", version="draft-1")
    draft_check = core.weight_checker(hf_state_checksums(new_state), model="draft")
    assert draft_check["match"], draft_check
    assert draft_check["weight_version"] == "draft-1"
    target_check = core.weight_checker(hf_state_checksums(old_state))
    assert target_check["match"] and target_check["checksums"] == target_sums  # the target was not touched
    tokens, drafted, accepted = _generate_counting(llm, PROMPTS[3:])  # prompts first cached now
    assert tokens == expected[3:]  # exact whatever the draft proposes
    assert drafted > 0 and accepted < drafted

    # The old weights back in the draft: every draft is right again. The prompts' blocks were cached
    # with the other draft's KV in them; the update reset the prefix cache, so none of that serves.
    _update(core, old_state, model="draft")
    assert core.weight_checker(model="draft")["checksums"] == target_sums
    tokens, drafted, accepted = _generate_counting(llm, PROMPTS[3:])
    assert tokens == expected[3:]
    assert drafted > 0 and accepted == drafted
    before = _acceptance(core)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[3:]], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 16 for o in outputs)  # now with prefix hits, cached by the right draft
    assert [o.outputs[0].token_ids for o in outputs] == expected[3:]
    drafted, accepted = (now - then for now, then in zip(_acceptance(core), before))
    assert drafted > 0 and accepted == drafted
    core.shutdown_weight_transfer_engine()
    core.shutdown()


def test_draft_update_recomputes_a_running_request_with_the_new_draft(states, expected):
    """Updated between steps of a running request: its draft KV (from the other weights) is recomputed,
    so every later draft is right, and its tokens are those of decoding without speculation."""
    path, old_state, new_state = states
    llm = _llm(path, draft=path)
    core = llm.engine_core
    core.init_weight_transfer_engine({"backend": "local", "model": "draft"})
    _update(core, new_state, model="draft")
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, detokenize=False)
    core.add_request(EngineCoreRequest("r", PROMPTS[0], params, eos_token_id=None))
    tokens = []
    for _ in range(4):  # prefill, then speculative steps with the other draft
        tokens += [t for o in core.step().outputs for t in o.new_token_ids]
    assert 0 < len(tokens) < 20
    _update(core, old_state, model="draft")
    drafted, accepted = _acceptance(core)
    while core.has_unfinished_requests():
        tokens += [t for o in core.step().outputs for t in o.new_token_ids]
    now_drafted, now_accepted = _acceptance(core)
    assert tokens == expected[0]
    assert now_drafted > drafted and now_accepted - accepted == now_drafted - drafted
    core.shutdown()


def test_one_update_lands_in_both_models(states, checkpoints):
    """start -> target tensors -> draft tensors -> finish: both serve the new weights, and with the
    new model as its own draft every draft is right again."""
    path, _, new_state = states
    new_path = checkpoints("llama")[1]
    plain = _llm(new_path)
    new_expected = _tokens(plain)
    plain.engine_core.shutdown()
    llm = _llm(path, draft=path)
    core = llm.engine_core
    core.init_weight_transfer_engine({"backend": "local"})
    core.init_weight_transfer_engine({"backend": "local", "model": "draft"})
    core.start_weight_update()
    core.update_weights(make_update_info(new_state.items()))
    core.update_weights({"model": "draft", **make_update_info(new_state.items())})
    core.finish_weight_update(weight_version="v1")
    new_sums = hf_state_checksums(new_state)
    assert core.weight_checker(new_sums)["match"] and core.weight_checker(new_sums, model="draft")["match"]
    tokens, drafted, accepted = _generate_counting(llm)
    assert tokens == new_expected
    assert drafted > 0 and accepted == drafted
    core.shutdown()


class _FailingLocal(LocalWeightTransferEngine):
    """The local backend whose peer dies after the first tensor of a call."""

    def receive_weights(self, info):
        for i, pair in enumerate(super().receive_weights(info)):
            if i == 1:
                raise ConnectionError("peer closed the connection")
            yield pair


register_engine_backend("local-failing", _FailingLocal)


def test_failed_draft_transfer_restores_both_models_and_ends_the_update(states, expected):
    path, _, new_state = states
    llm = _llm(path, draft=path)
    core = llm.engine_core
    sums = core.weight_checker()["checksums"]
    core.init_weight_transfer_engine({"backend": "local"})
    core.init_weight_transfer_engine({"backend": "local-failing", "model": "draft"})
    core.start_weight_update()
    core.update_weights(make_update_info(new_state.items()))  # the target's tensors land
    assert core.weight_checker()["checksums"] != sums
    with pytest.raises(WeightTransferError, match="ConnectionError: peer closed.*previous weights restored"):
        core.update_weights({"model": "draft", **make_update_info(new_state.items())})
    assert core.weight_checker()["checksums"] == sums
    assert core.weight_checker(model="draft")["checksums"] == sums
    with pytest.raises(RuntimeError, match="no weight update in progress"):
        core.finish_weight_update()
    tokens, drafted, accepted = _generate_counting(llm)  # serving again, with the old weights
    assert tokens == expected and accepted == drafted
    core.shutdown()


def test_draft_calls_are_refused_clearly(states, expected):
    """Naming the draft of an engine without one, or an unknown model, is a ValueError that changes nothing."""
    path, _, new_state = states
    llm = _llm(path)
    core = llm.engine_core
    sums = core.weight_checker()["checksums"]
    no_draft = "'draft' names the draft model, but this engine has none"
    with pytest.raises(ValueError, match=f"init_info.model: {no_draft}"):
        core.init_weight_transfer_engine({"backend": "local", "model": "draft"})
    with pytest.raises(ValueError, match=f"model: {no_draft}"):
        core.weight_info(model="draft")
    with pytest.raises(ValueError, match=f"model: {no_draft}"):
        core.weight_checker(model="draft")
    with pytest.raises(ValueError, match=r"init_info.model: expected one of \['target', 'draft'\], got 'critic'"):
        core.init_weight_transfer_engine({"backend": "local", "model": "critic"})
    core.init_weight_transfer_engine({"backend": "local", "model": "target"})  # the default, named
    core.start_weight_update()
    with pytest.raises(ValueError, match=f"update_info.model: {no_draft}"):
        core.update_weights({"model": "draft", **make_update_info(new_state.items())})
    core.finish_weight_update()  # the refused call left the update in progress, and changed nothing
    assert core.weight_checker()["checksums"] == sums
    assert _tokens(llm) == expected
    core.shutdown()

    spec = _llm(path, draft=path)
    core = spec.engine_core
    core.init_weight_transfer_engine({"backend": "local"})
    core.start_weight_update()
    with pytest.raises(RuntimeError, match="the draft model has no weight transfer engine; call "
                                           "init_weight_transfer_engine with init_info \"model\": 'draft' first"):
        core.update_weights({"model": "draft", **make_update_info(new_state.items())})
    with pytest.raises(RuntimeError, match="a weight update is in progress; finish it first"):
        core.init_weight_transfer_engine({"backend": "local", "model": "draft"})
    bad = {"model.norm.weight": new_state["model.norm.weight"][:-1]}
    core.finish_weight_update()
    core.init_weight_transfer_engine({"backend": "local", "model": "draft"})
    core.start_weight_update()
    with pytest.raises(ValueError, match=r"no weight was changed: 'model.norm.weight': shape \[63\]"):
        core.update_weights({"model": "draft", **make_update_info(bad.items())})
    core.finish_weight_update()
    assert core.weight_checker(model="draft")["checksums"] == sums
    core.shutdown()


def test_trainer_syncs_the_draft_through_a_client_for_it(states):
    """The trainer side: client.for_model("draft") makes any backend sync the draft (here the local
    backend, through a RolloutWorker whose engine runs in its own process)."""
    from rollout.worker import RolloutWorker
    from weight_transfer.base import StateDictSource, trainer_init
    from weight_transfer.clients import LocalWeightSyncClient
    from weight_transfer.local import LocalTrainerInitInfo

    path, old_state, new_state = states
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    with RolloutWorker(model=path, multiprocess=True, device="cpu", dtype="float32", max_model_len=128,
                       speculative_config=spec) as worker:
        client = LocalWeightSyncClient(worker)
        draft_client = client.for_model("draft")
        engine = trainer_init(LocalTrainerInitInfo(max_bytes_per_call=1 << 16), client=draft_client,
                              source=StateDictSource(new_state))
        stats = engine.send_weights(weight_version="draft-1")
        assert stats.num_tensors == len(new_state)
        assert draft_client.weight_checker(hf_state_checksums(new_state))["match"]
        assert client.weight_checker(hf_state_checksums(new_state), model="draft")["match"]
        assert client.weight_checker(hf_state_checksums(old_state))["match"]  # the target's are as they were
        assert client.weight_info()["weight_version"] == "draft-1"
        assert draft_client.weight_info()["weights"] == client.weight_info()["weights"]
        engine.shutdown()


@pytest.mark.slow
def test_draft_sync_over_the_http_rl_routes(launch_server, states, expected):
    """`rollout launch --speculative-config ... --enable-rl-routes`: a trainer syncs the draft over HTTP
    (HTTPWeightSyncClient.for_model("draft"), local backend in base64), reads it back with
    /weight_info?model=draft and /weight_checker {"model": "draft"}; the target and the outputs stay."""
    import json

    import httpx

    from weight_transfer.base import StateDictSource, trainer_init
    from weight_transfer.clients import HTTPWeightSyncClient, WeightSyncError
    from weight_transfer.local import LocalTrainerInitInfo

    path, old_state, new_state = states
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    server = launch_server(path, "--enable-rl-routes", "--served-model-name", "tiny", "--block-size", "16",
                           "--speculative-config", json.dumps(spec))
    client = HTTPWeightSyncClient(server.url, timeout=120)
    draft_client = client.for_model("draft")
    engine = trainer_init(LocalTrainerInitInfo(encoding="b64"), client=draft_client, source=StateDictSource(new_state))
    engine.send_weights(weight_version="draft-1")
    with httpx.Client(base_url=server.url, timeout=120) as http:
        info = http.get("/weight_info", params={"model": "draft"}).json()
        assert info["weight_version"] == "draft-1" and info["weights"] == http.get("/weight_info").json()["weights"]
        check = http.post("/weight_checker", json={"baseline": hf_state_checksums(new_state), "model": "draft"}).json()
        assert check["match"] is True, check
        target = http.post("/weight_checker", json={"baseline": hf_state_checksums(old_state)}).json()
        assert target["match"] is True  # the target is as it was
        for prompt, tokens in zip(PROMPTS[:2], expected):
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 20,
                                                    "temperature": 0.0, "ignore_eos": True,
                                                    "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == tokens
        r = http.get("/weight_info", params={"model": "critic"})
        assert r.status_code == 400 and "model: expected one of ['target', 'draft']" in r.json()["error"]["message"]
    assert client.weight_checker(hf_state_checksums(new_state), model="draft")["match"]
    engine.shutdown()

    plain = launch_server(path, "--enable-rl-routes")  # no draft model: naming it is a 400 that changes nothing
    plain_client = HTTPWeightSyncClient(plain.url, timeout=120)
    with pytest.raises(WeightSyncError, match="HTTP 400: init_info.model: 'draft' names the draft model, but this "
                                              "engine has none"):
        plain_client.for_model("draft").init_weight_transfer_engine({"backend": "local"})
    with pytest.raises(WeightSyncError, match="HTTP 400: model: 'draft' names the draft model"):
        plain_client.weight_checker(model="draft")
    assert plain_client.weight_checker(hf_state_checksums(old_state))["match"]
    client.close()
    plain_client.close()

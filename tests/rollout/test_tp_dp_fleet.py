"""A TP=2 x DP=2 fleet behind one `rollout launch` server: weight updates over HTTP land each rank's own slice."""

from __future__ import annotations

import os

import httpx
import pytest
import torch
from safetensors.torch import load_file

from engine.tiny_models import make_tiny_checkpoint
from weight_transfer import hf_state_checksums

pytestmark = pytest.mark.slow  # a server, two engine processes and four worker processes on 2 CPU cores

MODEL = "tiny-fleet"


@pytest.fixture(scope="module")
def server(launch_server, tiny_checkpoint):
    return launch_server(tiny_checkpoint("qwen3"), "--tensor-parallel-size", "2", "--data-parallel-size", "2",
                         "--distributed-executor-backend", "mp", "--served-model-name", MODEL, "--enable-rl-routes")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _check_every_rank_holds_its_slice_of(http, state: dict[str, torch.Tensor], version: str) -> None:
    # The tiny qwen3 ties its LM head to the embedding: the engine reports the alias with the embedding's slice.
    state = {"lm_head.weight": state["model.embed_tokens.weight"], **state}
    info = http.get("/weight_info").json()
    report = http.post("/weight_checker").json()
    assert info["weight_version"] == report["weight_version"] == version
    assert len(info["engines"]) == len(report["engines"]) == 2
    for engine, (engine_info, engine_report) in enumerate(zip(info["engines"], report["engines"])):
        ranks, checked = engine_info["ranks"], engine_report["ranks"]
        assert len(ranks) == len(checked) == 2
        assert ranks[0] != ranks[1]  # each rank holds its own slices (sharded weights name different starts)
        for rank, (weights, checks) in enumerate(zip(ranks, checked)):
            expected = hf_state_checksums(state, shards=weights)  # the trainer's shard of each tensor for this rank
            assert checks["checksums"] == expected, f"engine {engine} rank {rank}"


def _greedy(http, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_a_local_update_over_http_lands_each_ranks_slice_on_every_engine(http, tiny_checkpoint, tmp_path_factory):
    from weight_transfer.local import make_update_info

    assert http.get("/get_world_size").json() == {"world_size": 4}
    original = load_file(os.path.join(tiny_checkpoint("qwen3"), "model.safetensors"))
    _check_every_rank_holds_its_slice_of(http, original, "default")
    before = _greedy(http, "The quick brown fox")["token_ids"]
    new = load_file(os.path.join(make_tiny_checkpoint(tmp_path_factory.mktemp("fleet-seed1"), "qwen3", seed=1),
                                 "model.safetensors"))
    for path, body in [
        ("/pause?mode=wait", None),
        ("/init_weight_transfer_engine", {"init_info": {"backend": "local"}}),
        ("/start_weight_update", None),
        ("/update_weights", {"update_info": make_update_info(new.items(), encoding="b64")}),
        ("/finish_weight_update", {"weight_version": "v1"}),
        ("/resume", None),
    ]:
        r = http.post(path, json=body) if body is not None else http.post(path)
        assert r.status_code == 200, (path, r.text)
    _check_every_rank_holds_its_slice_of(http, new, "v1")
    assert _greedy(http, "The quick brown fox")["token_ids"] != before  # the new weights serve


def test_an_nccl_sync_over_gloo_reaches_all_four_workers_at_their_own_ranks(http, server, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    from weight_transfer.base import trainer_init
    from weight_transfer.clients import HTTPWeightSyncClient
    from weight_transfer.nccl import NCCLTrainerInitInfo

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen3"), dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    client = HTTPWeightSyncClient(server.url)
    # The trainer is rank 0; engine i's worker r joins at 1 + 2 i + r (the group rewrites rank_offset per engine).
    world_size = 1 + http.get("/get_world_size").json()["world_size"]
    trainer = trainer_init(NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=world_size,
                                               timeout_s=60.0), client=client, source=model)
    try:
        trainer.send_weights(weight_version="nccl-1")
    finally:
        trainer.shutdown()
        client.close()
    _check_every_rank_holds_its_slice_of(http, dict(model.state_dict()), "nccl-1")


def test_launch_with_the_ray_executor_serves_what_one_rank_serves(launch_server, tiny_checkpoint):
    from engine import LLM, SamplingParams

    prompts = ["Once upon a time", "hello world"]
    single = LLM(tiny_checkpoint("qwen3"), device="cpu", dtype="float32", max_model_len=256, disable_log_stats=True)
    expected = [o.outputs[0].token_ids for o in single.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)]
    # The engine process starts (or joins) a Ray cluster and places its two ranks as actors.
    ray_server = launch_server(tiny_checkpoint("qwen3"), "--tensor-parallel-size", "2",
                               "--distributed-executor-backend", "ray", "--served-model-name", MODEL, "--enable-rl-routes")
    with httpx.Client(base_url=ray_server.url, timeout=120) as ray_http:
        assert ray_http.get("/get_world_size").json() == {"world_size": 2}
        assert [_greedy(ray_http, p)["token_ids"] for p in prompts] == [list(t) for t in expected]

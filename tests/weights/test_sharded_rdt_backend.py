"""The sharded_rdt backend: BAKE and REPLAY over real NIXL (UCX, host memory), then end to end with Ray actors.

The end-to-end tests run a trainer in this process (an HF model with changed weights) and
RolloutWorker engines as Ray actors on a local cluster, driven through RayWeightSyncClient.
"""

from __future__ import annotations

import json
import re
import threading
import time

import msgspec
import pytest
import torch
from torch import nn

from weight_transfer.base import ModuleSource, WeightSource, trainer_init
from weight_transfer.checksums import hf_state_checksums, tensor_checksum
from weight_transfer.clients import RayWeightSyncClient
from weight_transfer.packing import tensor_list
from weight_transfer.rdt_plan import bake_consumed_ranges, build_plan, element_runs, group_sizes
from weight_transfer.rdt_producer import RDTProducer
from weight_transfer.sharded_rdt import (
    ShardedRDTTrainerInitInfo,
    ShardedRDTWeightTransferEngine,
    _pack_group,
)

from ray_engine import engine_greedy, ray_cluster, start_engine, stop_engine  # noqa: F401  (ray_cluster: fixture)
from sync_helpers import hf_greedy, trainer_model

TIMEOUT_S = 5.0
CHUNK_BYTES = 16 * 1024  # several packs per group on the tiny model


# ---------------------------------------------------------------------------------------
# BAKE and REPLAY in one process: a producer object and a consumer, real NIXL between them.


class ShardedLinears(nn.Module):
    """Two linears as tensor-parallel rank 1 of 2 holds them: rows 4..8 of "rows.weight", columns 3..6 of "cols"."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = nn.Parameter(torch.zeros(4, 6), requires_grad=False)
        self.cols = nn.Parameter(torch.zeros(5, 3), requires_grad=False)
        self.rows.weight_loader = lambda p, w: p.data.copy_(w.narrow(0, 4, 4))
        self.cols.weight_loader = lambda p, w: p.data.copy_(w[:, 3:6])

    def load_weights(self, weights):
        for name, tensor in weights:
            param = {"rows.weight": self.rows, "cols.weight": self.cols}[name]
            param.weight_loader(param, tensor)


class InProcessPair:
    """A producer object and a consumer engine in this process, real NIXL (UCX) between them; sync id 3."""

    SYNC_ID = 3

    def __init__(self, tensors: dict[str, torch.Tensor], model: nn.Module | None = None, num_slots: int = 1,
                 timeout_s: float = TIMEOUT_S, device: str = "cpu") -> None:
        self.names = list(tensors)
        self.values = list(tensors.values())
        dtypes, shapes = [t.dtype for t in self.values], [tuple(t.shape) for t in self.values]
        self.plan = build_plan(self.names, dtypes, shapes, group_sizes(self.names), 256)
        self.num_slots = num_slots
        self.producer = RDTProducer(0, num_slots, timeout_s, device=device)
        self.consumer = ShardedRDTWeightTransferEngine(torch.device(device))
        if model is not None:
            self.consumer.bind_model(model)
        self.consumer.init_transfer(self.consumer.parse_init_info({"backend": "sharded_rdt", "timeout_s": timeout_s}))
        update_info = {"sync_id": self.SYNC_ID, **tensor_list(self.names, dtypes, shapes),
                       "group_sizes": group_sizes(self.names), "chunk_bytes": 256, "num_slots": num_slots,
                       "producers": [self.producer.begin_sync(self.SYNC_ID, 1, self.plan.slot_bytes)]}
        self.info = self.consumer.parse_update_info(json.loads(json.dumps(update_info)))  # JSON-safe, as over HTTP

    def publish(self, groups: range | None = None) -> None:
        for g in groups if groups is not None else range(len(self.plan.groups)):
            group = self.plan.groups[g]
            payload = _pack_group(self.plan, g, self.values[group.start : group.end]).numpy()
            self.producer.publish(self.SYNC_ID, g, self.plan.slot(g, 1, self.num_slots), payload)

    def close(self) -> None:
        self.consumer.shutdown()


def _replay_in_process(tensors: dict[str, torch.Tensor], model: nn.Module | None, num_slots: int = 1,
                       device: str = "cpu"):
    """Publishes `tensors` from an in-process producer and receives them with a consumer bound to `model`."""
    pair = InProcessPair(tensors, model, num_slots, device=device)

    def publish() -> None:
        pair.publish()
        pair.producer.wait_drained(pair.SYNC_ID)

    thread = threading.Thread(target=publish)
    thread.start()
    received = {}
    for name, view in pair.consumer.receive_weights(pair.info):
        received[name] = view.clone()  # the view's buffer is reused once the generator resumes
        if model is not None:
            model.load_weights([(name, view)])
    thread.join()
    pair.close()
    return received, pair.consumer.last_bytes_read, pair.producer.stats()


def test_bake_records_the_slices_loaders_consume():
    ranges = bake_consumed_ranges(ShardedLinears(), ["rows.weight", "cols.weight"],
                                  [torch.float32, torch.float32], [(8, 6), (5, 6)])
    assert ranges["rows.weight"] == [(4 * 6 * 4, 8 * 6 * 4)]  # one run: the second half of the rows
    assert ranges["cols.weight"] == [((r * 6 + 3) * 4, (r * 6 + 6) * 4) for r in range(5)]  # 3 columns of each row
    assert element_runs(0, (2, 3), (3, 1)) == [(0, 6)]  # a contiguous view is one run


def test_bake_on_the_engine_model_consumes_every_tensor_whole_and_changes_nothing(tiny_checkpoint):
    from weight_helpers import read_state

    from engine.models.loader import load_hf_config, load_model

    path = tiny_checkpoint("llama")
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    before = {n: tensor_checksum(p) for n, p in model.named_parameters()}
    state = read_state(path)
    ranges = bake_consumed_ranges(model, list(state), [t.dtype for t in state.values()],
                                  [tuple(t.shape) for t in state.values()])
    assert ranges == {n: [(0, t.numel() * t.element_size())] for n, t in state.items()}
    assert {n: tensor_checksum(p) for n, p in model.named_parameters()} == before


def test_replay_pulls_only_the_baked_slices_and_lands_them():
    gen = torch.Generator().manual_seed(0)
    tensors = {"rows.weight": torch.randn(8, 6, generator=gen), "cols.weight": torch.randn(5, 6, generator=gen)}
    model = ShardedLinears()
    received, bytes_read, _ = _replay_in_process(tensors, model)
    assert bytes_read == (4 * 6 + 5 * 3) * 4  # the consumed slices, not the 78 floats of both tensors
    assert torch.equal(model.rows, tensors["rows.weight"][4:])
    assert torch.equal(model.cols, tensors["cols.weight"][:, 3:])
    assert torch.equal(received["rows.weight"][:4], torch.zeros(4, 6))  # never stale bytes from the ring buffer
    assert torch.equal(received["cols.weight"][:, :3], torch.zeros(5, 3))


def test_replay_without_a_model_moves_every_byte_through_one_slot():
    gen = torch.Generator().manual_seed(1)
    tensors = {
        "model.embed_tokens.weight": torch.randn(40, 8, generator=gen),
        "model.layers.0.a.weight": torch.randn(8, 8, generator=gen).to(torch.bfloat16),
        "model.layers.0.b.weight": torch.randn(3, generator=gen),
        "model.layers.1.a.weight": torch.randn(30, 8, generator=gen),  # larger than a chunk: a pack of its own
        "model.norm.weight": torch.randn(8, generator=gen),
    }
    received, bytes_read, stats = _replay_in_process(tensors, None, num_slots=1)
    assert all(torch.equal(received[n], t) and received[n].dtype == t.dtype for n, t in tensors.items())
    assert bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())
    assert stats["groups_published"] == 4 and stats["max_groups_held"] == 1


def _layers(num_layers: int) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.w": torch.full((4, 4), float(i)) for i in range(num_layers)}


def test_a_stalled_producer_is_a_timeout_on_both_sides_naming_the_group():
    pair = InProcessPair(_layers(3), timeout_s=1.0)
    pair.publish(range(1))  # group 0 only, then the trainer stalls
    received = []
    with pytest.raises(TimeoutError, match=r"group 1 \('model.layers.1.w'\) of sync 3 .* not published within 1.0 s"):
        for name, _ in pair.consumer.receive_weights(pair.info):
            received.append(name)
    assert received == ["model.layers.0.w"]
    # The consumer acked group 0 but never reads group 1: the producer's wait for its slot times out too.
    pair.publish(range(1, 2))
    with pytest.raises(TimeoutError, match="waited 1.0 s for every consumer to finish reading"):
        pair.producer.wait_drained(pair.SYNC_ID)
    pair.close()


def test_a_trainer_abort_stops_a_waiting_consumer_at_its_next_poll():
    pair = InProcessPair(_layers(2), timeout_s=60.0)
    pair.publish(range(1))
    received = pair.consumer.receive_weights(pair.info)
    assert next(received)[0] == "model.layers.0.w"
    threading.Timer(0.2, pair.producer.abort, args=(pair.SYNC_ID,)).start()
    with pytest.raises(RuntimeError, match="the trainer aborted sync 3"):
        next(received)
    pair.close()


# ---------------------------------------------------------------------------------------
# Validation: bad init or update info is a ValueError naming the field.


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"lookahead_groups": 0}, "init_info.lookahead_groups"),
        ({"chunk_bytes": 10}, "init_info.chunk_bytes"),
        ({"num_recv_buffers": 0}, "init_info.num_recv_buffers"),
        ({"timeout_s": 0}, "init_info.timeout_s"),
        ({"nixl_backend": ""}, "init_info.nixl_backend"),
        ({"producer_device": "tpu"}, "init_info.producer_device"),
        ({"rank": 2, "world_size": 2}, "init_info.rank"),
    ],
)
def test_bad_trainer_init_info_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ShardedRDTTrainerInitInfo(**kwargs)


def test_trainer_init_rejects_unknown_fields_before_starting_anything():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['bogus'\]"):
        trainer_init({"backend": "sharded_rdt", "bogus": 1}, client=None)


@pytest.mark.parametrize(
    "init_info,field",
    [
        ({"backend": "sharded_rdt", "timeout_s": -1}, "init_info.timeout_s"),
        ({"backend": "sharded_rdt", "num_recv_buffers": 0}, "init_info.num_recv_buffers"),
        ({"backend": "sharded_rdt", "nixl_backend": 3}, "init_info.nixl_backend"),
        ({"backend": "sharded_rdt", "extra": 1}, r"unknown field\(s\) \['extra'\]"),
    ],
)
def test_bad_engine_init_info_names_the_field(init_info, field):
    with pytest.raises(ValueError, match=field):
        ShardedRDTWeightTransferEngine(torch.device("cpu")).parse_init_info(init_info)


def _update_info() -> dict:
    names = ["model.layers.0.w", "model.layers.1.w"]
    return {
        "sync_id": 5,
        **tensor_list(names, [torch.float32] * 2, [[4, 4], [4, 4]]),
        "group_sizes": [1, 1],
        "chunk_bytes": 1024,
        "num_slots": 2,
        "producers": [{"rank": 0, "agent_name": "p0", "agent_metadata_b64": "bWQ=", "mem_type": "DRAM",
                       "device_id": 0, "slots": [[4096, 256], [8192, 256]], "status": [65536, 24]}],
    }


@pytest.mark.parametrize(
    "change,field",
    [
        (lambda u: u.update(sync_id=-1), "update_info.sync_id"),
        (lambda u: u.update(dtypes=["float32", "floaty"]), r"update_info.dtypes\[1\]"),
        (lambda u: u.update(shapes=[[4, 4]]), "2 names, 2 dtypes, 1 shapes"),
        (lambda u: u.update(group_sizes=[1, 2]), "update_info.group_sizes"),
        (lambda u: u.update(chunk_bytes=8), "update_info.chunk_bytes"),
        (lambda u: u.update(num_slots=0), "update_info.num_slots"),
        (lambda u: u.update(producers=[]), "update_info.producers"),
        (lambda u: u.pop("sync_id"), r"missing field\(s\) \['sync_id'\]"),
        (lambda u: u.update(extra=1), r"unknown field\(s\) \['extra'\]"),
        (lambda u: u["producers"][0].update(rank=1), r"update_info.producers\[0\].rank"),
        (lambda u: u["producers"][0].update(agent_metadata_b64="@@"), r"producers\[0\].agent_metadata_b64"),
        (lambda u: u["producers"][0].update(mem_type="HBM"), r"producers\[0\].mem_type"),
        (lambda u: u["producers"][0].update(slots=[[4096, 256]]), r"producers\[0\].slots: expected 2"),
        (lambda u: u["producers"][0].update(slots=[[4096, 16], [8192, 16]]), r"producers\[0\].slots: .*cannot hold"),
        (lambda u: u["producers"][0].update(status=[65536, 8]), r"producers\[0\].status"),
        (lambda u: u["producers"][0].pop("agent_name"), r"producers\[0\]: .*missing field\(s\) \['agent_name'\]"),
    ],
)
def test_bad_update_info_names_the_field(change, field):
    engine = ShardedRDTWeightTransferEngine(torch.device("cpu"))
    good = _update_info()
    assert engine.parse_update_info(good).names == good["names"]
    bad = _update_info()
    change(bad)
    with pytest.raises(ValueError, match=field):
        engine.parse_update_info(bad)


# ---------------------------------------------------------------------------------------
# End to end: trainer here, RolloutWorker engines as Ray actors.


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_checkpoint):  # noqa: F811
    actor = start_engine(tiny_checkpoint("llama"))
    yield actor
    stop_engine(actor)


def _assert_serves(actor, model: nn.Module, version: str) -> None:
    import ray

    assert engine_greedy(actor) == hf_greedy(model)
    report = ray.get(actor.weight_checker.remote(hf_state_checksums(model.state_dict())), timeout=60)
    assert report["match"], {k: report[k] for k in ("mismatches", "missing", "unexpected")}
    assert ray.get(actor.get_weight_version.remote(), timeout=60) == version


def _info(name: str) -> ShardedRDTTrainerInitInfo:
    return ShardedRDTTrainerInitInfo(lookahead_groups=1, chunk_bytes=CHUNK_BYTES, timeout_s=TIMEOUT_S, name=name)


def _wait_dead(actor) -> None:
    import ray

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:  # a busy actor: its queued call fails once it is dead
            continue
        time.sleep(0.05)
    raise AssertionError("the killed actor is still alive after 60 s")


class KillingSource(WeightSource):
    """A model's tensors, except that `victim` (a Ray actor) is killed just before tensor number `at` is yielded."""

    def __init__(self, model: nn.Module, victim, at: int) -> None:
        self.inner, self.victim, self.at = ModuleSource(model), victim, at

    def _metadata(self):
        return self.inner.metadata

    def iter_full(self):
        import ray

        for i, item in enumerate(self.inner.iter_full()):
            if i == self.at:
                ray.kill(self.victim)
                _wait_dead(self.victim)  # ray.kill is asynchronous: a call sent right after could still run
            yield item

    def iter_local(self):
        return self.iter_full()


@pytest.mark.slow
def test_sync_over_ray_lands_twice_and_the_producer_holds_at_most_lookahead_groups(engine, tiny_checkpoint):
    path = tiny_checkpoint("llama")
    model_a, model_b = trainer_model(path, seed=11), trainer_model(path, seed=12)
    info = _info("rdt-sync")
    trainer = trainer_init(info, client=RayWeightSyncClient([engine]), source=model_a)  # dispatches on the backend
    try:
        stats = trainer.send_weights(weight_version="a")
        _assert_serves(engine, model_a, "a")
        trainer.send_weights(model_b, weight_version="b")
        _assert_serves(engine, model_b, "b")
        producer = trainer.producer_stats()
    finally:
        trainer.shutdown()
    params = dict(model_a.named_parameters())
    assert stats.num_tensors == len(params)
    assert stats.bytes_sent == stats.dense_bytes == sum(p.numel() * p.element_size() for p in params.values())
    num_groups = stats.extra["num_groups"]
    assert num_groups > info.lookahead_groups  # the bound had to hold back the trainer
    assert producer["groups_published"] == 2 * num_groups
    assert producer["max_groups_held"] == info.lookahead_groups


@pytest.mark.slow
def test_producer_killed_mid_sync_fails_within_timeout_and_the_engine_keeps_its_weights(engine, tiny_checkpoint):
    import ray

    before_tokens = engine_greedy(engine)
    before_version = ray.get(engine.get_weight_version.remote())
    before_checksums = ray.get(engine.weight_checker.remote())["checksums"]
    trainer = trainer_init(_info("rdt-kill-producer"), client=RayWeightSyncClient([engine]))
    model = trainer_model(tiny_checkpoint("llama"), seed=13)
    names = [n for n, _ in model.named_parameters()]
    # Killed before the last group is published. With one slot, the trainer could publish the
    # group before it only after the engine acked the one before that, i.e. after the engine
    # had landed the embeddings: the engine has changed weights when the producer dies.
    at = len(names) - group_sizes(names)[-1]
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="sharded_rdt: sync .* failed") as failure:
            trainer.send_weights(KillingSource(model, trainer.producer.actor, at=at), weight_version="never")
    finally:
        trainer.shutdown()
    # Bounded, not hung: the engine's own update failed once the producer was gone (its timeout at most).
    assert time.monotonic() - started < TIMEOUT_S + 30
    # The engine's own update failed, naming the tensor it was on (it had landed the embeddings at least).
    assert re.search(r"the engine reported: .* at 'model\.layers\.\d+\.[a-z_.]+'.*sharded_rdt: ", str(failure.value))
    assert ray.get(engine.weight_checker.remote())["checksums"] == before_checksums
    assert ray.get(engine.get_weight_version.remote()) == before_version
    assert engine_greedy(engine) == before_tokens


@pytest.mark.slow
def test_two_trainer_ranks_each_publish_their_own_groups(engine, tiny_checkpoint):
    model = trainer_model(tiny_checkpoint("llama"), seed=15)
    client = RayWeightSyncClient([engine])
    results: dict[int, object] = {}

    def rank_main(rank: int) -> None:  # what each rank of a two-rank trainer runs (here: two threads)
        try:
            info = msgspec.structs.replace(_info("rdt-two-ranks"), rank=rank, world_size=2)
            trainer = trainer_init(info, client=client, source=model)
            try:
                trainer.send_weights(weight_version="two-ranks")
                results[rank] = trainer.producer_stats()
            finally:
                trainer.shutdown()
        except BaseException as e:  # reported below
            results[rank] = e

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert all(isinstance(results.get(rank), dict) for rank in (0, 1)), results
    num_groups = len(group_sizes([n for n, _ in model.named_parameters()]))
    assert [results[rank]["groups_published"] for rank in (0, 1)] == [(num_groups + 1) // 2, num_groups // 2]
    _assert_serves(engine, model, "two-ranks")


@pytest.mark.slow
def test_engine_killed_mid_sync_then_a_restarted_engine_rejoins_the_same_producer(engine, tiny_checkpoint):
    # Last in the module: it kills the shared engine actor.
    path = tiny_checkpoint("llama")
    model = trainer_model(path, seed=14)
    trainer = trainer_init(_info("rdt-rejoin"), client=RayWeightSyncClient([engine]))
    try:
        num_tensors = len(list(model.parameters()))
        with pytest.raises(RuntimeError, match="sharded_rdt: sync .* failed"):
            trainer.send_weights(KillingSource(model, engine, at=num_tensors // 2), weight_version="lost")
        restarted = start_engine(path)
        try:
            trainer.connect_engines(RayWeightSyncClient([restarted]))
            trainer.send_weights(model, weight_version="rejoined")
            _assert_serves(restarted, model, "rejoined")
            assert trainer.producer_stats()["max_groups_held"] == 1
        finally:
            stop_engine(restarted)
    finally:
        trainer.shutdown()


# ---- producer_host="thread": no Ray; the producer lives in the trainer process --------------------------


def test_a_thread_hosted_producer_needs_a_one_rank_trainer():
    with pytest.raises(ValueError, match="init_info.producer_host"):
        ShardedRDTTrainerInitInfo(producer_host="actor")
    info = ShardedRDTTrainerInitInfo(producer_host="thread", rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"producer_host: 'thread' serves a one-rank trainer.*2 ranks"):
        trainer_init(info, client=None)


@pytest.mark.slow
def test_a_thread_hosted_producer_syncs_a_server_over_http_without_ray(launch_server, tiny_checkpoint):
    from sync_helpers import assert_engine_serves

    from weight_transfer.clients import HTTPWeightSyncClient

    path = tiny_checkpoint("llama")
    server = launch_server(path, "--enable-rl-routes")
    model_a, model_b = trainer_model(path, seed=21), trainer_model(path, seed=22)
    info = msgspec.structs.replace(_info("rdt-thread"), producer_host="thread")
    client = HTTPWeightSyncClient(server.url)
    trainer = trainer_init(info, client=client, source=model_a)
    try:
        stats = trainer.send_weights(weight_version="t-a")
        assert_engine_serves(server.url, model_a, "t-a")
        trainer.send_weights(model_b, weight_version="t-b")
        assert_engine_serves(server.url, model_b, "t-b")
        producer = trainer.producer_stats()
    finally:
        trainer.shutdown()
        client.close()
    assert producer["groups_published"] == 2 * stats.extra["num_groups"]
    assert producer["max_groups_held"] == info.lookahead_groups  # the same memory bound as an actor's
    assert trainer.producer.producer.agent is None  # shutdown deregistered the producer's memory

"""Executor.rpc: a Worker method named by reference, its arguments bound to the method's signature before anything is sent."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from engine.executor.base import Executor
from engine.worker.worker import Worker


class RecordingExecutor(Executor):
    """Sends nothing anywhere: records each collective_rpc and answers for every rank."""

    def __init__(self, world_size: int = 2) -> None:
        super().__init__(SimpleNamespace(parallel=SimpleNamespace(tensor_parallel_size=world_size)), max_model_len=64)
        self.sent: list[tuple[str, tuple, dict | None]] = []

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None, unique_reply_rank: int | None = None
    ) -> list[Any]:
        self.sent.append((method, args, kwargs))
        return [(rank, method) for rank in range(self.world_size)]

    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def test_rpc_sends_the_methods_name_and_returns_every_ranks_result_in_rank_order():
    executor = RecordingExecutor(world_size=3)
    assert executor.rpc(Worker.sleep, 2) == [(0, "sleep"), (1, "sleep"), (2, "sleep")]
    executor.rpc(Worker.weight_checker, None, model="draft")
    executor.rpc(Worker.synchronize)
    assert executor.sent == [("sleep", (2,), {}), ("weight_checker", (None,), {"model": "draft"}),
                             ("synchronize", (), {})]


@pytest.mark.parametrize("args, kwargs, match", [
    ((), {}, "missing a required argument: 'level'"),
    ((1, 2), {}, "too many positional arguments"),
    ((1,), {"levle": 1}, "got an unexpected keyword argument 'levle'"),
])
def test_arguments_that_do_not_fit_the_method_are_a_type_error_and_nothing_is_sent(args, kwargs, match):
    executor = RecordingExecutor()
    with pytest.raises(TypeError, match=rf"rpc\(Worker.sleep\): {match}"):
        executor.rpc(Worker.sleep, *args, **kwargs)
    assert executor.sent == []


class NotTheWorker:
    def sleep(self, level: int) -> None:
        pass


@pytest.mark.parametrize("method", [NotTheWorker.sleep, lambda worker: None, Worker._warm_up_kernels, "sleep"],
                         ids=["same-name-elsewhere", "lambda", "private", "a-string"])
def test_only_a_public_worker_method_can_be_called(method):
    executor = RecordingExecutor()
    with pytest.raises(TypeError, match="expected a public Worker method"):
        executor.rpc(method)
    assert executor.sent == []

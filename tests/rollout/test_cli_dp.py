"""`rollout launch` flags for data parallelism (ours) and tensor parallelism (the engine's ParallelConfig)."""

from __future__ import annotations

import dataclasses

import pytest

from rollout.cli import build_parser, main
from rollout.cli_args import field_docs, flag_name
from engine.config import ParallelConfig


def test_parallel_flags_are_in_launch_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["launch", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "engine: parallel:" in text
    for f in dataclasses.fields(ParallelConfig):
        assert flag_name(f.name) in text
        assert field_docs(ParallelConfig)[f.name].replace(" ", "") in text.replace(" ", "")
    assert "--tensor-parallel-size" in text and "--distributed-executor-backend" in text


def test_parallel_flags_parse():
    args = build_parser().parse_args(["launch", "--model", "m", "--data-parallel-size", "2",
                                      "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"])
    assert (args.data_parallel_size, args.tensor_parallel_size, args.distributed_executor_backend) == (2, 2, "mp")
    assert "data_parallel_size" not in vars(build_parser().parse_args(["launch", "--model", "m"]))


@pytest.mark.parametrize("value", [0, -1, True])
def test_data_parallel_size_must_be_positive(value):
    with pytest.raises(ValueError, match="data_parallel_size"):
        ParallelConfig(data_parallel_size=value)


def test_a_bad_data_parallel_size_fails_before_starting(tiny_checkpoint, capsys):
    assert main(["launch", "--model", tiny_checkpoint("llama"), "--data-parallel-size", "0"]) == 2
    assert "data_parallel_size" in capsys.readouterr().err

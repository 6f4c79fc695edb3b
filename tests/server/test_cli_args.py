"""The launch CLI is generated from the config dataclasses: every field is a typed, documented flag."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import ENGINE_CONFIG_SECTIONS
from rollout.cli import build_parser
from rollout.cli_args import field_docs, flag_name
from rollout.server.config import ServerConfig

ALL_SECTIONS = [*ENGINE_CONFIG_SECTIONS.values(), ServerConfig]


def _launch_help(capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["launch", "--help"])
    assert exit_info.value.code == 0
    # argparse wraps lines; compare with whitespace collapsed.
    return " ".join(capsys.readouterr().out.split())


def test_every_config_field_is_in_help_with_its_docstring(capsys):
    text = _launch_help(capsys)
    for cls in ALL_SECTIONS:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert f.name in docs, f"{cls.__name__}.{f.name} has no attribute docstring"
            assert flag_name(f.name) in text, f"{flag_name(f.name)} missing from --help"
            # argparse may break a long word at a hyphen, so compare without spaces.
            assert docs[f.name].replace(" ", "") in text.replace(" ", ""), f"help of {f.name} missing"
    for section in ENGINE_CONFIG_SECTIONS:
        assert f"engine: {section}:" in text
    assert "server:" in text


def test_unset_flags_keep_dataclass_defaults():
    args = build_parser().parse_args(["launch", "--model", "m"])
    assert vars(args).keys() >= {"model", "command", "func"}
    assert "block_size" not in vars(args) and "port" not in vars(args)


def test_flag_types():
    args = build_parser().parse_args(
        [
            "launch", "--model", "m", "--max-model-len", "128", "--gpu-memory-utilization", "0.5",
            "--no-enable-prefix-caching", "--disable-log-stats", "--dtype", "float32",
            "--stat-loggers", "a", "b", "--port", "0", "--api-key", "k",
        ]
    )
    assert args.max_model_len == 128 and args.gpu_memory_utilization == 0.5
    assert args.enable_prefix_caching is False and args.disable_log_stats is True
    assert args.dtype == "float32" and args.stat_loggers == ["a", "b"]
    assert args.port == 0 and args.api_key == "k"


@pytest.mark.parametrize(
    "argv",
    [
        ["launch"],  # --model is required
        ["launch", "--model", "m", "--dtype", "float64"],  # not a choice
        ["launch", "--model", "m", "--max-num-seqs", "many"],  # not an int
        ["launch", "--model", "m", "--no-such-flag"],
    ],
)
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2


def test_invalid_values_fail_before_starting(tmp_path, capsys):
    from rollout.cli import main

    assert main(["launch", "--model", str(tmp_path / "missing")]) == 2
    assert "model" in capsys.readouterr().err


def test_server_config_validates():
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key="")
    assert ServerConfig().host == "127.0.0.1"

"""Trainer configs: validation naming the field, the generated CLI, and YAML/TOML config files overridden by flags."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from trainers.cli import build_parser, parse_config
from trainers.config import AlgorithmConfig, LoggingConfig, ModelConfig, OptimConfig, RolloutConfig, TrainerConfig


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: RolloutConfig(temperature=0.0), "rollout.temperature"),
        (lambda: RolloutConfig(num_samples_per_prompt=1), "rollout.num_samples_per_prompt"),
        (lambda: RolloutConfig(max_tokens=64, max_model_len=64), "rollout.max_tokens"),
        (lambda: AlgorithmConfig(loss="ppo"), "algorithm.loss"),
        (lambda: AlgorithmConfig(clip_low=1.5), "algorithm.clip_low"),
        (lambda: AlgorithmConfig(dual_clip=0.5), "algorithm.dual_clip"),
        (lambda: AlgorithmConfig(mismatch="drop"), "algorithm.mismatch"),
        (lambda: AlgorithmConfig(mismatch_cap=0.5), "algorithm.mismatch_cap"),
        (lambda: OptimConfig(lr=0.0), "optim.lr"),
        (lambda: OptimConfig(beta2=1.0), "optim.beta2"),
        (lambda: ModelConfig(path="/nonexistent"), "model.path"),
        (lambda: LoggingConfig(wandb_mode="cloud"), "logging.wandb_mode"),
        (lambda: LoggingConfig(console="tty"), "logging.console"),
        (lambda: LoggingConfig(wandb_project=" "), "logging.wandb_project"),
        (lambda: LoggingConfig(output_dir=""), "logging.output_dir"),
        (lambda: RolloutConfig(colocate=True, async_mode=True), "rollout.colocate"),
    ],
)
def test_bad_values_name_the_field(build, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build()


def test_every_leaf_field_has_a_flag_with_its_docstring():
    parser = build_parser(TrainerConfig)
    flags = {a.dest: a for a in parser._actions}
    for name, cls in (("rollout", RolloutConfig), ("algorithm", AlgorithmConfig), ("optim", OptimConfig),
                      ("logging", LoggingConfig)):
        for f in dataclasses.fields(cls):
            assert f"{name}.{f.name}" in flags, f.name
            assert flags[f"{name}.{f.name}"].help and "(default:" in flags[f"{name}.{f.name}"].help
    assert "num_steps" in flags and "model.path" in flags


def test_toml_file_then_flags_on_top(model_dir, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        f'num_steps = 7\n[model]\npath = "{model_dir}"\n'
        '[rollout]\ntemperature = 0.7\nnum_samples_per_prompt = 6\n'
        '[algorithm]\nloss = "dapo"\nkl_coef = 0\n[optim]\nlr = 3e-4\n'
    )
    config = parse_config(TrainerConfig, ["--config", str(path), "--optim.lr", "1e-3", "--algorithm.clip-high", "none",
                                          "--no-logging.save-final"])
    assert config.num_steps == 7 and config.model.path == model_dir
    assert config.rollout.temperature == 0.7 and config.rollout.num_samples_per_prompt == 6
    assert config.algorithm.loss == "dapo" and config.algorithm.kl_coef == 0.0 and config.algorithm.clip_high is None
    assert config.optim.lr == 1e-3  # the flag wins over the file
    assert config.logging.save_final is False
    assert config.rollout.max_tokens == RolloutConfig().max_tokens  # untouched fields keep their defaults


def test_yaml_file(model_dir, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"model:\n  path: {model_dir}\nalgorithm:\n  loss: dr_grpo\n  mismatch: mask\n")
    config = parse_config(TrainerConfig, ["--config", str(path)])
    assert (config.algorithm.loss, config.algorithm.mismatch) == ("dr_grpo", "mask")


@pytest.mark.parametrize(
    "text, field",
    [
        ("[optim]\nlrr = 1e-3\n", "optim.lrr"),
        ("[rollout]\ntemperature = \"hot\"\n", "rollout.temperature"),
        ("[algorithm]\nloss = \"ppo\"\n", "algorithm.loss"),
        ("[rollout]\nmax_tokens = 0\n", "rollout.max_tokens"),
        ("[bogus]\nx = 1\n", "bogus"),
    ],
)
def test_bad_file_values_name_the_field(model_dir, tmp_path, text, field):
    path = tmp_path / "bad.toml"
    path.write_text(f'[model]\npath = "{model_dir}"\n' + text)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse_config(TrainerConfig, ["--config", str(path)])


def test_missing_required_field_names_it():
    with pytest.raises(ValueError, match=r"model\.path"):
        parse_config(TrainerConfig, [])


def test_module_help_lists_the_flags():
    result = subprocess.run([sys.executable, "-m", "trainers.grpo", "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    for flag in ("--config", "--model.path", "--rollout.temperature", "--algorithm.mismatch-cap", "--optim.max-grad-norm",
                 "--rollout.colocate", "--logging.wandb-mode", "--logging.wandb-project", "--logging.console"):
        assert flag in result.stdout


def test_module_reports_a_bad_flag_value_naming_the_field(model_dir):
    result = subprocess.run([sys.executable, "-m", "trainers.grpo", "--model.path", model_dir, "--rollout.temperature", "0"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert "error: rollout.temperature: must be > 0.0" in result.stderr, result.stderr


def test_logging_defaults_are_offline_and_neutral():
    config = LoggingConfig()
    assert config.wandb_mode == "offline" and config.output_dir == "runs/train"


def test_rollout_gpu_memory_utilization_is_passed_to_the_worker_and_checked(monkeypatch, tiny_checkpoint):
    from trainers import common

    with pytest.raises(ValueError, match="rollout.gpu_memory_utilization"):
        RolloutConfig(gpu_memory_utilization=1.5)
    seen = {}
    monkeypatch.setattr("rollout.RolloutWorker", lambda **kwargs: seen.update(kwargs))
    common.start_worker(ModelConfig(path=tiny_checkpoint("llama")), RolloutConfig(gpu_memory_utilization=0.4))
    assert seen["gpu_memory_utilization"] == 0.4
    seen.clear()
    common.start_worker(ModelConfig(path=tiny_checkpoint("llama")), RolloutConfig())
    assert "gpu_memory_utilization" not in seen  # the engine's own default

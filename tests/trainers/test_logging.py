"""MetricsLogger and PhaseTimer: the offline wandb run and metrics.jsonl, summary.json, the PNG curve, rank gating, console output and bad input."""

from __future__ import annotations

import glob
import json
import math
import os
import socket
import struct

import pytest

from trainers.config import LoggingConfig
from trainers.logging import METRICS, MetricsConfig, MetricsLogger, PhaseTimer, histogram_summary, read_history

RUN_CONFIG = {"num_steps": 3, "algorithm": {"loss": "grpo", "kl_coef": 0.05}, "optim": {"lr": 1e-5}}
STALENESS = [0, 0, 0, 1, 1, 2]


def step_metrics(step: int) -> dict[str, float]:
    """A value for every documented metric name, distinct per step and per name."""
    return {name: step + index / 100 for index, name in enumerate(METRICS)}


@pytest.fixture(scope="module")
def network_attempts():
    """Forbids (and records) any connection from this process to a non-loopback address while the module runs.

    The environment also asks wandb to go online at a dead local address: only the logger's
    explicit offline mode keeps the run local, so a logger that let the environment win fails here.
    """
    attempts: list[object] = []
    original = socket.socket.connect

    def guarded(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(address)
            raise OSError(f"test forbids network access to {address!r}")
        return original(sock, address)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", guarded)
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_MODE", "online")
        mp.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
        mp.delenv("WANDB_API_KEY", raising=False)
        yield attempts


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, network_attempts):
    """One offline run shared by the checks: 3 steps of every metric, a staleness histogram, a reward curve, a summary."""
    run_dir = str(tmp_path_factory.mktemp("runs") / "demo")
    config = MetricsConfig(output_dir=run_dir, wandb_project="test-project", wandb_tags="grpo, tiny", console="off")
    logger = MetricsLogger(config, RUN_CONFIG, rank=0)
    for step in (1, 2, 3):
        logger.log(step_metrics(step), step)
    logger.log_histogram("staleness", STALENESS, step=3)
    png = logger.plot_curve("reward/mean")
    wandb_dir = logger.wandb_dir
    logger.finish({"accuracy_before": 0.1, "accuracy_after": 0.6})
    return {"run_dir": run_dir, "png": png, "wandb_dir": wandb_dir, "logger": logger}


def read_wandb_records(path: str) -> list:
    """The protobuf Records of a .wandb file: a 7-byte ':W&B' header, then leveldb-log chunks in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    block, header = 32768, 7
    pos, pending, records = 7, b"", []
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:  # block tail too short for a chunk header: zero padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk = data[pos + header : pos + header + length]
        pos += header + length
        if kind == 1:  # full
            records.append(chunk)
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            records.append(pending + chunk)
        elif kind == 0 and length == 0:  # padding to the block end
            pos += left - header
    parsed = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        parsed.append(record)
    return parsed


def wandb_history(records) -> dict[int, dict[str, object]]:
    """Step -> {metric: value}; a histogram's parts (stored under nested keys) come back as one dict."""
    history: dict[int, dict[str, object]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row: dict[str, object] = {}
            for item in record.history.item:
                *parents, leaf = [item.key] if item.key else list(item.nested_key)
                node = row
                for parent in parents:
                    node = node.setdefault(parent, {})
                node[leaf] = json.loads(item.value_json)
            history.setdefault(row["_step"], {}).update(row)
    return history


def test_offline_wandb_run_holds_every_metric_and_the_config(finished_run, network_attempts):
    run_dir = finished_run["run_dir"]
    offline_dirs = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*"))
    assert len(offline_dirs) == 1, offline_dirs  # offline although WANDB_MODE=online is in the environment
    assert finished_run["wandb_dir"] == offline_dirs[0]
    assert not glob.glob(os.path.join(run_dir, "wandb", "run-*"))  # no online run folder
    (wandb_file,) = glob.glob(os.path.join(offline_dirs[0], "run-*.wandb"))

    records = read_wandb_records(wandb_file)
    history = wandb_history(records)
    for step in (1, 2, 3):
        for name, value in step_metrics(step).items():
            assert history[step][name] == pytest.approx(value), (step, name)
    assert history[3]["staleness"]["_type"] == "histogram"
    assert sum(history[3]["staleness"]["values"]) == len(STALENESS)

    config = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind in ("config", "run"):
            updates = record.config.update if kind == "config" else record.run.config.update
            config.update({u.key: json.loads(u.value_json) for u in updates})
    assert config["algorithm"] == RUN_CONFIG["algorithm"]
    assert config["optim"] == RUN_CONFIG["optim"] and config["num_steps"] == 3

    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert runs and runs[0].project == "test-project" and runs[0].display_name == "demo"
    assert list(runs[0].tags) == ["grpo", "tiny"]
    assert network_attempts == []


def test_metrics_jsonl_has_every_step_and_the_histogram_counts(finished_run):
    run_dir = finished_run["run_dir"]
    history = read_history(run_dir)
    assert [record["step"] for record in history] == [1, 2, 3]
    for record in history:
        for name, value in step_metrics(record["step"]).items():
            assert record[name] == pytest.approx(value), name
    assert history[2]["staleness"]["counts"] == {"0": 3, "1": 2, "2": 1}
    assert history[2]["staleness"]["max"] == 2.0
    assert history[2]["staleness"]["mean"] == pytest.approx(sum(STALENESS) / len(STALENESS))
    # one line per call: 3 log() lines and the histogram line
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert len([line for line in f if line.strip()]) == 4
    assert all(record.pop("elapsed_s") >= 0 for record in history)  # wall time since start, in the file only
    assert finished_run["logger"].history == history  # the in-memory history plot_curve draws from
    with open(os.path.join(run_dir, "run_config.json")) as f:
        assert json.load(f) == RUN_CONFIG


def test_summary_json(finished_run):
    with open(os.path.join(finished_run["run_dir"], "summary.json")) as f:
        summary = json.load(f)
    assert summary["accuracy_before"] == 0.1 and summary["accuracy_after"] == 0.6
    assert summary["status"] == "finished"
    assert summary["steps_logged"] == 3 and summary["last_step"] == 3
    assert summary["last_metrics"]["reward/mean"] == pytest.approx(step_metrics(3)["reward/mean"])
    assert summary["wandb_dir"] == finished_run["wandb_dir"]


def test_reward_curve_is_a_valid_png(finished_run):
    png = finished_run["png"]
    assert png == os.path.join(finished_run["run_dir"], "reward_mean.png")
    with open(png, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (600, 350)
    assert data[-8:-4] == b"IEND"
    import matplotlib.image

    pixels = matplotlib.image.imread(png)
    assert pixels.shape[:2] == (350, 600)
    assert pixels.std() > 0  # something was drawn, not a blank canvas


def test_logging_after_finish_is_refused(finished_run):
    logger = finished_run["logger"]
    with pytest.raises(ValueError, match="step"):
        logger.log({"kl": 0.0}, step=4)
    logger.finish()  # idempotent


def test_non_zero_rank_writes_nothing(tmp_path, network_attempts):
    run_dir = tmp_path / "rank1"
    logger = MetricsLogger(MetricsConfig(output_dir=str(run_dir)), RUN_CONFIG, rank=1)
    logger.log(step_metrics(1), 1)
    logger.log_histogram("staleness", STALENESS, 1)
    assert logger.plot_curve("reward/mean") is None
    logger.finish({"accuracy_after": 1.0})
    assert logger.wandb_run is None and logger.history == []
    assert not run_dir.exists()
    assert list(tmp_path.iterdir()) == []


def test_console_lines_show_the_key_metrics(tmp_path, capsys):
    config = MetricsConfig(output_dir=str(tmp_path / "run"), wandb_mode="disabled", console="lines")
    with MetricsLogger(config, {}) as logger:
        logger.log({"reward/mean": 0.25, "accuracy": 0.5, "kl": 0.001, "weight_version": 1.0, "loss": 3.0}, 1)
        logger.log({"reward/mean": 0.75, "accuracy": 1.0, "kl": 0.002, "weight_version": 2.0}, 2)
        logger.log({"time/sync": 0.1}, 2)  # same step: no second line
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert lines == [
        "step 1: reward=0.25 acc=0.5 kl=0.001 version=1",
        "step 2: reward=0.75 acc=1 kl=0.002 version=2",
    ]
    assert not (tmp_path / "run" / "wandb").exists()  # disabled: no wandb files at all
    assert read_history(str(tmp_path / "run"))[1]["time/sync"] == pytest.approx(0.1)


def test_console_bar_counts_steps_and_off_prints_nothing(tmp_path, capsys):
    config = MetricsConfig(output_dir=str(tmp_path / "bar"), wandb_mode="disabled", console="bar")
    logger = MetricsLogger(config, {"num_steps": 2})
    for step in (1, 2):
        logger.log({"reward/mean": 0.5, "weight_version": float(step)}, step)
    logger.finish()
    err = capsys.readouterr().err
    assert "2/2" in err and "version=2" in err

    quiet = MetricsConfig(output_dir=str(tmp_path / "off"), wandb_mode="disabled", console="off")
    with MetricsLogger(quiet, {"num_steps": 2}) as logger:
        logger.log({"reward/mean": 0.5}, 1)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_non_finite_metrics_become_null_in_jsonl(tmp_path):
    config = MetricsConfig(output_dir=str(tmp_path), wandb_mode="disabled", console="off")
    with MetricsLogger(config, {}) as logger:
        logger.log({"kl": float("nan"), "entropy": 1.5}, 0)
        assert math.isnan(logger.history[0]["kl"])
    with open(tmp_path / "metrics.jsonl") as f:
        line = json.loads(f.readline())  # strict JSON: no NaN token
    assert line["kl"] is None and line["entropy"] == 1.5


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"wandb_mode": "cloud"}, "logging.wandb_mode"),
        ({"console": "fancy"}, "logging.console"),
        ({"output_dir": ""}, "logging.output_dir"),
        ({"wandb_project": " "}, "logging.wandb_project"),
        ({"wandb_name": ""}, "logging.wandb_name"),
        ({"wandb_tags": ["a"]}, "logging.wandb_tags"),
        ({"wandb_tags": "x" * 65}, "logging.wandb_tags"),
        ({"wandb_system_metrics": "yes"}, "logging.wandb_system_metrics"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        MetricsConfig(**kwargs)


def test_bad_logger_arguments_name_the_field(tmp_path):
    config = MetricsConfig(output_dir=str(tmp_path), wandb_mode="disabled", console="off")
    with pytest.raises(ValueError, match="rank"):
        MetricsLogger(config, {}, rank=-1)
    with pytest.raises(ValueError, match="run_config"):
        MetricsLogger(config, [("num_steps", 3)])
    with MetricsLogger(config, {}) as logger:
        with pytest.raises(ValueError, match=r"metrics\['kl'\]"):
            logger.log({"kl": "high"}, 1)
        with pytest.raises(ValueError, match=r"metrics\['step'\]"):
            logger.log({"step": 1.0}, 1)
        with pytest.raises(ValueError, match="step"):
            logger.log({"kl": 0.1}, -1)
        logger.log({"kl": 0.1}, 5)
        with pytest.raises(ValueError, match="step: 4 is below"):
            logger.log({"kl": 0.1}, 4)
        with pytest.raises(ValueError, match="values"):
            logger.log_histogram("staleness", [], 5)
        with pytest.raises(ValueError, match="name"):
            logger.log_histogram("", [1], 5)
        with pytest.raises(ValueError, match="metric"):
            logger.plot_curve("reward/mean")
        with pytest.raises(ValueError, match="summary"):
            logger.finish(["not", "a", "dict"])


def test_trainer_logging_config_is_accepted(tmp_path):
    """The trainers' LoggingConfig section feeds the logger: shared fields copied, wandb fields at their defaults until it has them."""
    section = LoggingConfig(output_dir=str(tmp_path / "grpo"))
    config = MetricsConfig.from_config(section)
    assert config.output_dir == section.output_dir
    assert config.wandb_mode == getattr(section, "wandb_mode", "offline")


def test_histogram_summary_bins_non_integer_values():
    summary = histogram_summary([0.5, 1.25, 3.0, 3.0])
    assert summary["num"] == 4 and summary["min"] == 0.5 and summary["max"] == 3.0
    assert len(summary["bin_edges"]) == len(summary["counts"]) + 1
    assert sum(summary["counts"]) == 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phase_timer_accumulates_seconds_per_phase():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    with timer("generate"):
        clock.now += 2.0
    with timer("reward"):
        clock.now += 0.5
    with timer.phase("generate"):  # re-entering adds
        clock.now += 2.0
    with pytest.raises(RuntimeError), timer("train"):
        clock.now += 1.0
        raise RuntimeError("the phase's time still counts")
    assert timer.as_metrics(num_tokens=400) == {
        "time/generate": 4.0,
        "time/reward": 0.5,
        "time/train": 1.0,
        "tokens_per_s": 100.0,
    }
    assert timer.tokens_per_s(20, phase="reward") == 40.0
    timer.reset()
    assert timer.as_metrics() == {} and timer.seconds("generate") == 0.0


def test_phase_timer_bad_input_names_the_field():
    timer = PhaseTimer(clock=FakeClock())
    with pytest.raises(ValueError, match="phase"):
        timer.tokens_per_s(10)  # generate never timed
    with pytest.raises(ValueError, match="num_tokens"):
        timer.tokens_per_s(-1)
    with pytest.raises(ValueError, match="name"), timer("time/train"):
        pass
    with timer("sync"), pytest.raises(ValueError, match="already running"), timer("sync"):
        pass

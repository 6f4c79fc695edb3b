"""Run metrics for the trainers: a wandb run (offline by default), metrics.jsonl, a console progress line, plots and phase timers.

    logger = MetricsLogger(config.logging, to_dict(config), rank=rank)
    for step in range(1, num_steps + 1):
        timer = PhaseTimer()
        with timer("generate"):
            ...
        logger.log({"reward/mean": r, "kl": kl, **timer.as_metrics(num_tokens=n)}, step)
        logger.log_histogram("staleness", staleness_per_sample, step)
    logger.plot_curve("reward/mean")
    logger.finish({"accuracy_before": a0, "accuracy_after": a1})

Only rank 0 records anything; on other ranks every method is a no-op, so trainers call the
logger unconditionally. The run directory gets metrics.jsonl (one JSON line per `log` /
`log_histogram` call, each with its "step"), run_config.json, summary.json at the end, PNG
curves on request, and wandb/offline-run-*/ (upload later with `wandb sync <that dir>`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Literal, Self, get_args

import numpy as np

# The metric names trainers log, so dashboards, plots and tests agree; trainers may add others
# (loss, grad_norm, ...), these are the ones every GRPO/PPO step is expected to report.
METRICS: dict[str, str] = {
    "reward/mean": "mean reward over the step's samples",
    "reward/std": "standard deviation of the step's rewards",
    "accuracy": "fraction of the step's samples the verifier accepted (reward == 1 on exact-match tasks)",
    "kl": "KL estimate to the frozen reference policy (the configured estimator; only when KL is on)",
    "entropy": "mean token entropy of the policy on the response tokens",
    "clip_fraction": "fraction of response tokens whose ratio was clipped",
    "mismatch/abs": "mean |trainer logprob - engine logprob| over response tokens on the same weights",
    "mismatch/kl": "KL estimate between the engine's and the trainer's token distributions",
    "tokens_per_s": "generated tokens per second of the generate phase",
    "time/generate": "seconds spent generating rollouts this step",
    "time/reward": "seconds spent scoring rollouts this step",
    "time/train": "seconds spent in forward/backward/optimizer this step",
    "time/sync": "seconds spent sending weights to the rollout workers this step",
    "weight_version": "the weight version the rollout workers serve after this step",
    "staleness/mean": "mean age in weight versions of the samples trained on this step",
    "staleness/max": "largest age in weight versions of the samples trained on this step",
}

# Shown on the console line of each step: metric name -> short label.
CONSOLE_METRICS: dict[str, str] = {
    "reward/mean": "reward",
    "accuracy": "acc",
    "kl": "kl",
    "weight_version": "version",
}

WandbMode = Literal["offline", "online", "disabled"]
ConsoleMode = Literal["auto", "bar", "lines", "off"]

# Integer-valued histograms (staleness in versions) with at most this many distinct values are
# summarised as exact counts per value; anything else as counts over equal-width bins.
_MAX_EXACT_COUNTS = 64
_NUM_SUMMARY_BINS = 16
_WANDB_MAX_BINS = 512  # wandb.Histogram's limit on bins


@dataclass
class MetricsConfig:
    """Where a run records its metrics: the run directory, the wandb run and the console."""

    output_dir: str = "runs/grpo"
    """Run directory: metrics.jsonl, summary.json, plots and the wandb/ folder go here."""
    wandb_mode: WandbMode = "offline"
    """wandb run mode: offline (files only, never the network; `wandb sync` uploads later), online, or disabled."""
    wandb_project: str = "rollout-toolkit"
    """wandb project name."""
    wandb_name: str | None = None
    """wandb run name; none: the run directory's base name."""
    wandb_tags: str = ""
    """Comma-separated wandb tags."""
    wandb_system_metrics: bool = False
    """Let wandb sample CPU/GPU/memory and machine info (it may probe cloud metadata endpoints; off keeps offline runs local)."""
    console: ConsoleMode = "auto"
    """Console progress: auto (a tqdm bar on a TTY, else one line per step), bar, lines, or off."""

    def __post_init__(self) -> None:
        check_metrics_config(self)

    @classmethod
    def from_config(cls, config: Any) -> MetricsConfig:
        """A MetricsConfig from any config object carrying some of these fields (e.g. trainers.config.LoggingConfig); the rest keep their defaults."""
        if isinstance(config, cls):
            return config
        if config is None:
            raise ValueError("logging: config is None; pass a MetricsConfig or a LoggingConfig")
        values = {f.name: getattr(config, f.name) for f in fields(cls) if hasattr(config, f.name)}
        return cls(**values)


def check_metrics_config(config: Any, prefix: str = "logging.") -> None:
    """Validates the MetricsConfig fields of `config` (also usable from a LoggingConfig's __post_init__); ValueError names the field."""
    if not isinstance(config.output_dir, str) or not config.output_dir:
        raise ValueError(f"{prefix}output_dir: must be a non-empty path, got {config.output_dir!r}")
    if config.wandb_mode not in get_args(WandbMode):
        raise ValueError(f"{prefix}wandb_mode: {config.wandb_mode!r} is not one of {list(get_args(WandbMode))}")
    if not isinstance(config.wandb_project, str) or not config.wandb_project.strip():
        raise ValueError(f"{prefix}wandb_project: must be a non-empty string, got {config.wandb_project!r}")
    if config.wandb_name is not None and (not isinstance(config.wandb_name, str) or not config.wandb_name.strip()):
        raise ValueError(f"{prefix}wandb_name: must be a non-empty string or None, got {config.wandb_name!r}")
    if not isinstance(config.wandb_tags, str):
        raise ValueError(f"{prefix}wandb_tags: must be a comma-separated string, got {config.wandb_tags!r}")
    for tag in _split_tags(config.wandb_tags):
        if len(tag) > 64:  # wandb rejects longer tags at init; fail before the run starts
            raise ValueError(f"{prefix}wandb_tags: tag {tag!r} is longer than 64 characters")
    if not isinstance(config.wandb_system_metrics, bool):
        raise ValueError(f"{prefix}wandb_system_metrics: must be a bool, got {config.wandb_system_metrics!r}")
    if config.console not in get_args(ConsoleMode):
        raise ValueError(f"{prefix}console: {config.console!r} is not one of {list(get_args(ConsoleMode))}")


def _split_tags(text: str) -> list[str]:
    return [tag.strip() for tag in text.split(",") if tag.strip()]


def _finite_or_none(value: float) -> float | None:
    # JSON has no NaN/inf; metrics.jsonl stays parseable by any JSON reader
    return value if math.isfinite(value) else None


def _as_float(where: str, value: Any) -> float:
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    try:
        return float(value)  # ints, bools, numpy scalars, 0-d / 1-element tensors
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected a number, got {type(value).__name__}") from None


def _as_array(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):  # torch tensor, without importing torch here
        values = values.detach().cpu().numpy()
    try:
        array = np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ValueError("values: expected a sequence of numbers") from None
    if array.size == 0:
        raise ValueError("values: empty; a histogram needs at least one value")
    if not np.isfinite(array).all():
        raise ValueError("values: contains NaN or inf")
    return array


def histogram_summary(values: Any) -> dict[str, Any]:
    """Counts of `values` for metrics.jsonl: exact counts per value when they are few integers (staleness), else equal-width bins."""
    array = _as_array(values)
    summary: dict[str, Any] = {
        "num": int(array.size),
        "mean": float(array.mean()),
        "min": float(array.min()),
        "max": float(array.max()),
    }
    distinct, counts = np.unique(array, return_counts=True)
    if np.all(distinct == np.round(distinct)) and distinct.size <= _MAX_EXACT_COUNTS:
        summary["counts"] = {str(int(v)): int(c) for v, c in zip(distinct, counts)}
    else:
        bin_counts, edges = np.histogram(array, bins=_NUM_SUMMARY_BINS)
        summary["bin_edges"] = [float(e) for e in edges]
        summary["counts"] = [int(c) for c in bin_counts]
    return summary


def read_history(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (or of the run directory holding one), lines of the same step merged, in step order."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"path: no metrics.jsonl at {path!r}")
    by_step: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                by_step.setdefault(record["step"], {}).update(record)
    return [by_step[step] for step in sorted(by_step)]


class MetricsLogger:
    """Rank 0's run record: wandb run, metrics.jsonl, console progress, plots and summary.json; a no-op on other ranks."""

    def __init__(
        self,
        config: Any,
        run_config: dict[str, Any],
        rank: int = 0,
        *,
        num_steps: int | None = None,
    ) -> None:
        """`config`: a MetricsConfig or an object with its fields; `run_config`: the run's settings (recorded in wandb and
        run_config.json); `num_steps`: the progress bar's total (default run_config["num_steps"] when present)."""
        if type(rank) is not int or rank < 0:
            raise ValueError(f"rank: must be an int >= 0, got {rank!r}")
        if not isinstance(run_config, dict):
            raise ValueError(f"run_config: expected a dict, got {type(run_config).__name__}")
        if num_steps is None and isinstance(run_config.get("num_steps"), int):
            num_steps = run_config["num_steps"]
        if num_steps is not None and (not isinstance(num_steps, int) or num_steps < 0):
            raise ValueError(f"num_steps: must be an int >= 0 or None, got {num_steps!r}")
        self.config = MetricsConfig.from_config(config)
        self.rank = rank
        self.enabled = rank == 0
        self.run_dir = os.path.abspath(self.config.output_dir)
        self.wandb_run: Any = None
        self._history: dict[int, dict[str, Any]] = {}
        self._last_step: int | None = None
        self._finished = False
        self._lock = threading.Lock()  # async trainers may log from a generation thread and the training loop
        self._bar: Any = None
        self._file: Any = None
        if not self.enabled:
            return

        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "run_config.json"), "w") as f:
            json.dump(run_config, f, indent=2, default=str)
        # a new logger is a new run: the previous run's lines must not mix into this history
        self._file = open(os.path.join(self.run_dir, "metrics.jsonl"), "w")
        self._start = time.monotonic()
        if self.config.wandb_mode != "disabled":
            try:
                self.wandb_run = self._init_wandb(run_config)
            except BaseException:
                self._file.close()
                raise
        self._console = self._console_mode()
        if self._console == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=num_steps, unit="step", dynamic_ncols=True, file=sys.stderr, desc="train")

    # ---- setup -------------------------------------------------------------------------------

    def _init_wandb(self, run_config: dict[str, Any]) -> Any:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                f"logging.wandb_mode={self.config.wandb_mode!r} needs wandb (pip install 'rollout-toolkit[train]'); "
                "set logging.wandb_mode=disabled to run without it"
            ) from e
        offline = self.config.wandb_mode == "offline"
        quiet_system = not self.config.wandb_system_metrics
        settings = wandb.Settings(
            mode=self.config.wandb_mode,  # explicit: beats a WANDB_MODE in the environment, so offline stays offline
            silent=offline,  # offline: our one line below says where the run is; online: keep wandb's run URL
            console="off",  # wandb must not wrap stdout/stderr (the progress bar and the trainer own the console)
            x_disable_stats=quiet_system,
            x_disable_meta=quiet_system,
            x_disable_machine_info=quiet_system,
        )
        run = wandb.init(
            dir=self.run_dir,
            project=self.config.wandb_project,
            name=self.config.wandb_name or os.path.basename(self.run_dir),
            tags=_split_tags(self.config.wandb_tags),
            config=run_config,
            settings=settings,
            reinit="create_new",  # several loggers in one process (tests, sweeps) each get their own run
        )
        if offline:
            print(f"wandb: offline run in {run.settings.sync_dir} (upload with `wandb sync` on that path)", flush=True)
        return run

    def _console_mode(self) -> str:
        mode = self.config.console
        if mode == "auto":
            return "bar" if sys.stderr.isatty() else "lines"
        return mode

    @property
    def wandb_dir(self) -> str | None:
        """The wandb run's own directory (run_dir/wandb/offline-run-*), or None without a wandb run."""
        return None if self.wandb_run is None else self.wandb_run.settings.sync_dir

    @property
    def history(self) -> list[dict[str, Any]]:
        """Everything logged so far, one merged dict per step (with its "step"), in step order; empty on other ranks."""
        with self._lock:
            return [dict(self._history[step]) for step in sorted(self._history)]

    # ---- recording ---------------------------------------------------------------------------

    def _check_step(self, step: int) -> None:
        if type(step) is not int or step < 0:
            raise ValueError(f"step: must be an int >= 0, got {step!r}")
        # wandb drops (with a warning) anything logged at a step below the current one
        if self._last_step is not None and step < self._last_step:
            raise ValueError(f"step: {step} is below the last logged step {self._last_step}; steps must not go back")
        if self._finished:
            raise ValueError("step: the logger is finished; nothing more can be logged")

    def _record(self, step: int, values: dict[str, Any], jsonl_values: dict[str, Any]) -> None:
        # caller holds self._lock
        new_step = step not in self._history
        self._history.setdefault(step, {"step": step}).update(values)
        self._last_step = step
        line = {"step": step, "elapsed_s": round(time.monotonic() - self._start, 3), **jsonl_values}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()  # a crashed run keeps every step it finished
        if new_step:
            self._show(step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Records scalar `metrics` (names as in METRICS, or others) for `step`; calls for the same step merge."""
        if not self.enabled:
            return
        if not isinstance(metrics, dict):
            raise ValueError(f"metrics: expected a dict of name -> number, got {type(metrics).__name__}")
        values: dict[str, float] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name or name in ("step", "elapsed_s"):
                raise ValueError(
                    f"metrics[{name!r}]: names must be non-empty strings other than 'step' and 'elapsed_s'"
                )
            values[name] = _as_float(f"metrics[{name!r}]", value)
        with self._lock:
            self._check_step(step)
            if self.wandb_run is not None:
                self.wandb_run.log(values, step=step)
            self._record(step, values, {k: _finite_or_none(v) for k, v in values.items()})

    def log_histogram(self, name: str, values: Sequence[float] | Any, step: int) -> None:
        """Records the distribution of `values` (e.g. staleness per sample) for `step`: a wandb.Histogram and counts in metrics.jsonl."""
        if not self.enabled:
            return
        if not isinstance(name, str) or not name or name in ("step", "elapsed_s"):
            raise ValueError(f"name: must be a non-empty string other than 'step' and 'elapsed_s', got {name!r}")
        summary = histogram_summary(values)
        with self._lock:
            self._check_step(step)
            if self.wandb_run is not None:
                self.wandb_run.log({name: self._wandb_histogram(_as_array(values))}, step=step)
            self._record(step, {name: summary}, {name: summary})

    @staticmethod
    def _wandb_histogram(array: np.ndarray) -> Any:
        import wandb

        low, high = int(array.min()), int(array.max())
        if np.all(array == np.round(array)) and high - low < _WANDB_MAX_BINS:
            # one bin per integer value, centred on it, so a staleness of 1 is its own bar
            edges = np.arange(low, high + 2, dtype=np.float64) - 0.5
            return wandb.Histogram(np_histogram=np.histogram(array, bins=edges))
        return wandb.Histogram(array.tolist(), num_bins=64)

    def _show(self, step: int) -> None:
        shown = self._console_text(step)
        if self._console == "bar":
            self._bar.set_postfix_str(shown, refresh=False)
            self._bar.update(1)
        elif self._console == "lines":
            print(f"step {step}: {shown}", flush=True)

    def _console_text(self, step: int) -> str:
        record = self._history[step]
        parts = []
        for name, label in CONSOLE_METRICS.items():
            value = record.get(name)
            if isinstance(value, float):
                parts.append(f"{label}={int(value)}" if name == "weight_version" else f"{label}={value:.4g}")
        return " ".join(parts)

    # ---- outputs -----------------------------------------------------------------------------

    def plot_curve(self, metric: str, path: str | None = None) -> str | None:
        """Writes a PNG of `metric` over steps from the recorded history (default path run_dir/<metric>.png); returns the path."""
        if not self.enabled:
            return None
        with self._lock:
            points = [
                (step, record[metric])
                for step, record in sorted(self._history.items())
                if isinstance(record.get(metric), float)
            ]
        if not points:
            raise ValueError(f"metric: {metric!r} was never logged as a scalar")
        if path is None:
            path = os.path.join(self.run_dir, metric.replace("/", "_") + ".png")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # a bare Figure renders through Agg without touching pyplot's global backend
        from matplotlib.figure import Figure

        figure = Figure(figsize=(6, 3.5), dpi=100)
        axes = figure.subplots()
        steps, values = zip(*points)
        axes.plot(steps, values, marker="o" if len(points) <= 50 else None, markersize=3)
        axes.set_xlabel("step")
        axes.set_ylabel(metric)
        axes.set_title(f"{metric} ({os.path.basename(self.run_dir)})")
        axes.grid(True, alpha=0.3)
        figure.tight_layout()
        figure.savefig(path, format="png")
        return path

    def finish(self, summary: dict[str, Any] | None = None, *, failed: bool = False) -> None:
        """Writes summary.json (`summary`'s keys plus status, steps_logged and last_metrics), closes wandb and the bar; idempotent."""
        if not self.enabled or self._finished:
            return
        if summary is not None and not isinstance(summary, dict):
            raise ValueError(f"summary: expected a dict or None, got {type(summary).__name__}")
        with self._lock:
            self._finished = True
            last: dict[str, Any] = {}
            for step in sorted(self._history):
                last.update({k: v for k, v in self._history[step].items() if isinstance(v, float)})
            record: dict[str, Any] = {
                "status": "failed" if failed else "finished",
                "steps_logged": len(self._history),
                "last_step": self._last_step,
                "last_metrics": {k: _finite_or_none(v) for k, v in last.items()},
                "wandb_dir": self.wandb_dir,
                **(summary or {}),
            }
            with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
                json.dump(record, f, indent=2, default=str)
            self._file.close()
            if self._bar is not None:
                self._bar.close()
            if self.wandb_run is not None:
                self.wandb_run.summary.update({k: v for k, v in (summary or {}).items() if _is_plain(v)})
                self.wandb_run.finish(exit_code=1 if failed else 0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.finish(failed=exc_type is not None)


def _is_plain(value: Any) -> bool:
    """Whether `value` is a number or string wandb's run summary shows directly."""
    return isinstance(value, (int, float, str, bool))


class PhaseTimer:
    """Wall-clock seconds per named phase (generate, reward, train, sync) of one step; `with timer("train"): ...`.

    Re-entering a phase adds to its total; make one timer per step (or `reset()` it) so
    `as_metrics()` gives that step's seconds. Phases may run in different threads (async
    generation), but one phase name must not be open twice at once.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock  # injectable so tests can drive time
        self._seconds: dict[str, float] = {}
        self._open: set[str] = set()
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"name: a phase name must be a non-empty string without '/', got {name!r}")
        with self._lock:
            if name in self._open:
                raise ValueError(f"name: phase {name!r} is already running; phases of one name do not nest")
            self._open.add(name)
        start = self._clock()
        try:
            yield
        finally:
            elapsed = self._clock() - start
            with self._lock:
                self._open.discard(name)
                self._seconds[name] = self._seconds.get(name, 0.0) + elapsed

    phase = __call__

    def seconds(self, name: str) -> float:
        """Total seconds spent in phase `name` (0.0 if it never ran)."""
        with self._lock:
            return self._seconds.get(name, 0.0)

    def tokens_per_s(self, num_tokens: int, phase: str = "generate") -> float:
        """`num_tokens` divided by the seconds of `phase` (generation throughput by default)."""
        if type(num_tokens) is not int or num_tokens < 0:
            raise ValueError(f"num_tokens: must be an int >= 0, got {num_tokens!r}")
        seconds = self.seconds(phase)
        if seconds <= 0.0:
            raise ValueError(f"phase: {phase!r} has not been timed; no rate without a duration")
        return num_tokens / seconds

    def as_metrics(self, num_tokens: int | None = None) -> dict[str, float]:
        """{"time/<phase>": seconds} for every phase timed, plus "tokens_per_s" over the generate phase when `num_tokens` is given."""
        with self._lock:
            metrics = {f"time/{name}": seconds for name, seconds in self._seconds.items()}
        if num_tokens is not None:
            metrics["tokens_per_s"] = self.tokens_per_s(num_tokens)
        return metrics

    def reset(self) -> None:
        """Forgets the totals (open phases still add their time when they close)."""
        with self._lock:
            self._seconds.clear()

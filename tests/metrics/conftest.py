"""Fixtures for the metrics tests: an EngineConfig over the tiny checkpoint, and a fake stat logger plugin."""

import importlib.metadata
from typing import ClassVar

import pytest

from engine.metrics.base import StatLoggerBase
from engine.metrics.loggers import STAT_LOGGER_ENTRY_POINT_GROUP


@pytest.fixture
def engine_config(tiny_checkpoint):
    from engine.engine_args import create_engine_config

    return create_engine_config(model=tiny_checkpoint(), device="cpu", dtype="float32", max_model_len=64)


class RecordingLogger(StatLoggerBase):
    """A plugin stat logger that keeps every record() call."""

    instances: ClassVar[list["RecordingLogger"]] = []

    def __init__(self, config, engine_index):
        self.engine_index = engine_index
        self.records = []
        self.num_logs = 0
        RecordingLogger.instances.append(self)

    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        self.records.append((scheduler_stats, iteration_stats, engine_index))

    def log(self):
        self.num_logs += 1


class FakeEntryPoint:
    """Stands in for an importlib.metadata.EntryPoint."""

    def __init__(self, name, obj):
        self.name, self.obj = name, obj

    def load(self):
        return self.obj


@pytest.fixture
def recording_plugin(monkeypatch):
    """Installs RecordingLogger as entry point `recorder` of the stat logger group."""
    real = importlib.metadata.entry_points

    def entry_points(**kwargs):
        if kwargs.get("group") == STAT_LOGGER_ENTRY_POINT_GROUP:
            return [FakeEntryPoint("recorder", RecordingLogger)]
        return real(**kwargs)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    RecordingLogger.instances = []
    return RecordingLogger

"""Several frontends' Prometheus registries shown as one, each engine's series relabelled `engine="<its index>"`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from engine.metrics.prometheus import registry_snapshot
from engine.metrics.rl import frontend_metrics_text


class MultiEngineCollector:
    """A prometheus_client collector over per-engine registries (registry i belongs to engine i).

    Every frontend of a data-parallel group labels its own engine "0"; this collector rewrites
    the `engine` label to the registry's position, and merges families of the same name, since
    the text format allows one HELP/TYPE block per family. A series without an `engine` label
    (vllm:admission_rejections counts per frontend) is the same series in every registry: the
    group shows it once, its values added up (counters: the group's total).
    """

    def __init__(self, registries: Sequence[CollectorRegistry]) -> None:
        self.registries = list(registries)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        shared: dict[tuple, int] = {}  # (family, sample name, labels) of a series without `engine` -> its index
        for engine_index, registry in enumerate(self.registries):
            label = str(engine_index)
            for family in registry.collect():
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    if "engine" in sample.labels:
                        target.samples.append(sample._replace(labels={**sample.labels, "engine": label}))
                        continue
                    key = (family.name, sample.name, tuple(sorted(sample.labels.items())))
                    index = shared.get(key)
                    if index is None:
                        shared[key] = len(target.samples)
                        target.samples.append(sample)
                    elif not sample.name.endswith("_created"):  # _created: the first registry's stays
                        first = target.samples[index]
                        target.samples[index] = first._replace(value=first.value + sample.value)
        yield from merged.values()


class MultiEngineMetrics:
    """The /metrics text and the metrics snapshot of several engines, each under its own `engine` label."""

    def __init__(self, registries: Sequence[CollectorRegistry]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(MultiEngineCollector(registries))

    def prometheus_text(self) -> bytes:
        """The engines' families, then the frontend-wide RL families (once: they are the process's)."""
        return generate_latest(self.registry) + frontend_metrics_text()

    def snapshot(self) -> dict[str, float]:
        """Like PrometheusStatLogger.snapshot: counters added up over engines, fraction gauges averaged."""
        return registry_snapshot(self.registry)

"""Our /metrics families against the ones vLLM 0.33's own code registers: names, types, label names and
values, buckets and sample names, so a vLLM dashboard query finds our series.

vLLM's side is vLLM's code run here (tests/compat's import_vllm): its PrometheusStatLogger built over a
stand-in for VllmConfig carrying only what the logger reads (vLLM's real CacheConfig for the info gauge),
plus its RL and sleep-mode route metrics. Every `vllm:` name in vLLM's metric sources is either one we
match (checked family by family) or listed in NOT_MATCHED with the reason; a family vLLM adds in a later
release fails the test until it is decided.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from compat.conftest import skip_or_fail
from compat.vllm_modules import SITE, unavailable_reason
from engine.metrics import rl
from engine.metrics.loggers import StatLoggerManager

MAX_MODEL_LEN = 256
NUM_SPEC_TOKENS = 2

# vLLM families we do not have, and why: each exists in vLLM only under a setting that is off by
# default, or for a feature we lack. Every family vLLM registers always, we serve.
NOT_MATCHED = {
    "vllm:num_requests_kv_fetch_by_stage": "conditional: a KV-transfer consumer only; no KV connector here",
    "vllm:corrupted_requests": "conditional: VLLM_COMPUTE_NANS_IN_LOGITS only",
    "vllm:watermark_requests": "conditional: watermark_config only; no watermarking here",
    "vllm:kv_block_lifetime_seconds": "conditional: --kv-cache-metrics only",
    "vllm:kv_block_idle_before_evict_seconds": "conditional: --kv-cache-metrics only",
    "vllm:kv_block_reuse_gap_seconds": "conditional: --kv-cache-metrics only",
    "vllm:lora_requests_info": "conditional: LoRA only; no LoRA here",
    "vllm:diffusion_num_denoising_steps": "conditional: diffusion language models only",
    "vllm:diffusion_num_canvas_positions": "conditional: diffusion language models only",
    "vllm:diffusion_num_committed_tokens": "conditional: diffusion language models only",
}
# The files whose `vllm:` names are in scope: the engine stat logger, its spec-decode and perf
# families, the RL weight-transfer and sleep-mode route metrics.
VLLM_SOURCES = [
    "vllm/v1/metrics/loggers.py",
    "vllm/v1/metrics/perf.py",
    "vllm/v1/spec_decode/metrics.py",
    "vllm/entrypoints/rl/online/metrics.py",
    "vllm/entrypoints/serve/dev/sleep/metrics.py",
]
# Labels whose values are a fixed set in vLLM: ours must offer the same values.
ENUMERATED_LABELS = ("reason", "sleep_state", "source", "finished_reason", "position")
# vllm:cache_config_info labels we set with the same meaning as vLLM's CacheConfig field of that name.
CACHE_INFO_LABELS = {"block_size", "gpu_memory_utilization", "enable_prefix_caching", "num_gpu_blocks",
                     "num_gpu_blocks_override", "kv_cache_memory_bytes", "cache_dtype"}  # fmt: skip


def _families(text: bytes) -> dict[str, SimpleNamespace]:
    """The `vllm:` families of a /metrics body, parsed as Prometheus reads it: name -> type, label
    names, values per enumerated label, histogram bounds, sample-name suffixes. (prometheus_client
    writes a counter's or histogram's `_created` series as a gauge family of its own: left out.)"""
    out = {}
    for f in text_string_to_metric_families(text.decode()):
        if not f.name.startswith("vllm:") or f.name.endswith("_created"):
            continue
        labels = {k for s in f.samples for k in s.labels} - {"le"}
        out[f.name] = SimpleNamespace(
            type=f.type,
            labels=labels,
            values={k: {s.labels[k] for s in f.samples if k in s.labels} for k in ENUMERATED_LABELS if k in labels},
            bounds=sorted({float(s.labels["le"]) for s in f.samples if s.name.endswith("_bucket")}),
            suffixes={s.name[len(f.name):] for s in f.samples},
        )
    return out


@pytest.fixture(scope="module")
def vllm_families():
    """The families vLLM 0.33's own code registers at its defaults, with speculative decoding on."""
    reason = unavailable_reason()
    if reason is not None:
        skip_or_fail(reason)
    from compat.vllm_modules import import_vllm

    loggers = import_vllm("vllm.v1.metrics.loggers")
    cache = import_vllm("vllm.config.cache")
    rl_metrics = import_vllm("vllm.entrypoints.rl.online.metrics")
    sleep_metrics = import_vllm("vllm.entrypoints.serve.dev.sleep.metrics")
    vllm_config = SimpleNamespace(
        observability_config=SimpleNamespace(show_hidden_metrics=False, kv_cache_metrics=False,
                                             custom_histogram_buckets=None),
        model_config=SimpleNamespace(served_model_name="tiny", max_model_len=MAX_MODEL_LEN, is_diffusion=False),
        speculative_config=SimpleNamespace(num_speculative_tokens=NUM_SPEC_TOKENS),
        kv_transfer_config=None, ec_transfer_config=None, watermark_config=None, lora_config=None,
        cache_config=cache.CacheConfig(block_size=16),
    )  # fmt: skip
    # vLLM registers into prometheus_client's process-wide REGISTRY; its own unregister removes them after.
    unregister = import_vllm("vllm.v1.metrics.prometheus").unregister_vllm_metrics
    try:
        stat_logger = loggers.PrometheusStatLogger(vllm_config, [0, 1])
        stat_logger.log_engine_initialized()
        registry = CollectorRegistry()
        weight_ops = rl_metrics.WeightOperationMetrics(registry)
        sleep_ops = sleep_metrics.SleepModeOperationMetrics(registry)
        for op in rl.WEIGHT_OPERATIONS:
            with weight_ops.record(op):
                pass
        for op in rl.SLEEP_MODE_OPERATIONS:
            with sleep_ops.record(op):
                pass
        families = _families(generate_latest(REGISTRY)) | _families(generate_latest(registry))
    finally:
        unregister()
    return SimpleNamespace(families=families, cache_fields=set(vllm_config.cache_config.metrics_info()))


@pytest.fixture(scope="module")
def our_families(tiny_checkpoint):
    from engine.engine_args import create_engine_config

    config = create_engine_config(
        model=tiny_checkpoint(), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
        speculative_config={"method": "ngram", "num_speculative_tokens": NUM_SPEC_TOKENS},
    )  # fmt: skip
    manager = StatLoggerManager(config, "tiny", engine_indexes=[0, 1])
    manager.log_engine_initialized(num_gpu_blocks=100)
    for op in rl.WEIGHT_OPERATIONS:
        with rl.weight_operation_metrics().record(op):
            pass
    for op in rl.SLEEP_MODE_OPERATIONS:
        with rl.sleep_mode_operation_metrics().record(op):
            pass
    return _families(manager.prometheus_text())


def _vllm_names_in_sources() -> set[str]:
    names = set()
    for path in VLLM_SOURCES:
        tree = ast.parse((SITE / path).read_text())
        names |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                  and n.value.startswith("vllm:") and n.value[5:].replace("_", "").isalnum()}  # fmt: skip
    return names


def test_every_vllm_family_is_matched_or_explained(vllm_families, our_families):
    in_sources = _vllm_names_in_sources()
    registered = set(vllm_families.families)
    # A counter's family drops a `_total` its source name has (prometheus_client's rule).
    family_names = in_sources | {name.removesuffix("_total") for name in in_sources}
    assert registered <= family_names  # the source scan sees what vLLM's code registers
    undecided = {n for n in in_sources if n not in NOT_MATCHED and n not in registered
                 and n.removesuffix("_total") not in registered}  # fmt: skip
    assert not undecided, f"vLLM families neither registered at defaults here nor in NOT_MATCHED: {undecided}"
    for name in NOT_MATCHED:
        assert name in in_sources, f"{name} is no longer in vLLM's sources: drop it from NOT_MATCHED"
        assert name not in our_families, f"{name} is served now: take it out of NOT_MATCHED"
    # Only families vLLM makes under a non-default setting may be left out.
    assert not registered & set(NOT_MATCHED), registered & set(NOT_MATCHED)
    missing = registered - set(our_families)
    assert not missing, f"vLLM families we claim to match but do not serve: {sorted(missing)}"


def test_matched_families_have_vllms_type_labels_buckets_and_samples(vllm_families, our_families):
    matched = set(vllm_families.families) - set(NOT_MATCHED)
    assert len(matched) >= 40
    for name in sorted(matched):
        theirs, ours = vllm_families.families[name], our_families[name]
        assert ours.type == theirs.type, name
        assert ours.suffixes == theirs.suffixes, name  # _total / _created / _bucket / _count / _sum
        assert ours.bounds == theirs.bounds, name
        if name == "vllm:cache_config_info":  # labels are each project's CacheConfig fields
            assert CACHE_INFO_LABELS <= vllm_families.cache_fields | {"engine"}
            assert CACHE_INFO_LABELS | {"engine"} <= ours.labels
            continue
        assert ours.labels == theirs.labels, name
        assert ours.values == theirs.values, name


def test_our_own_families_keep_the_rollout_prefix(our_families, tiny_checkpoint):
    from engine.engine_args import create_engine_config

    config = create_engine_config(model=tiny_checkpoint(), device="cpu", max_model_len=MAX_MODEL_LEN)
    text = StatLoggerManager(config, "tiny").prometheus_text().decode()
    ours = {f.name for f in text_string_to_metric_families(text) if f.name.startswith("rollout:")}
    assert ours == {"rollout:engine_paused", "rollout:engine_sleep_level", "rollout:weight_update_duration_seconds",
                    "rollout:weight_version_info"}  # fmt: skip
    # Nothing else but prometheus_client's process and Python families, which vLLM's /metrics has too.
    others = {f.name for f in text_string_to_metric_families(text) if not f.name.startswith(("vllm:", "rollout:"))}
    assert {"process_resident_memory_bytes", "python_info"} <= others
    assert all(name.startswith(("process_", "python_")) for name in others), others

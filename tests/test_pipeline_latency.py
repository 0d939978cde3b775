"""The export latency histogram (``kvstream_pipeline_export_latency_seconds``): plain bucket
counts observed per export attempt, exported at scrape time, must read exactly as the
prometheus-client ``Histogram`` with the same buckets that it replaces."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvstream.sinks.memory import MemorySink
from pipeline_helpers import make_batch, source
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvstream.pipeline import Pipeline, PipelineConfig
from kvstream.pipeline.metrics import LATENCY_BUCKETS, LatencyHistogram

NAME = "kvstream_pipeline_export_latency_seconds"
ON_BOUNDS = st.sampled_from([*LATENCY_BUCKETS, 0.0, 1e-9, 31.0])
LATENCIES = st.floats(min_value=0.0, max_value=100.0, allow_nan=False) | ON_BOUNDS


def reference_samples(values: list[float]) -> dict[tuple[str, str], float]:
    registry = CollectorRegistry()
    h = Histogram(NAME, "d", ["pipeline", "sink"], registry=registry, buckets=LATENCY_BUCKETS)
    child = h.labels("p", "s")
    for v in values:
        child.observe(v)
    return samples(registry)


def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    """Bucket, count and sum samples of the latency family, by (sample name, le)."""
    return {
        (s.name, s.labels.get("le", "")): s.value
        for m in registry.collect()
        if m.name == NAME
        for s in m.samples
        if not s.name.endswith("_created")
    }


@given(st.lists(LATENCIES, max_size=60))
def test_buckets_equal_a_prometheus_histogram(values: list[float]) -> None:
    h = LatencyHistogram()
    for v in values:
        h.observe(v)
    want = reference_samples(values)
    got = {(f"{NAME}_bucket", le): n for le, n in h.buckets()}
    assert got == {k: v for k, v in want.items() if k[0] == f"{NAME}_bucket"}
    assert want[(f"{NAME}_count", "")] == len(values) == h.buckets()[-1][1]
    assert math.isclose(want[(f"{NAME}_sum", "")], h.sum, rel_tol=1e-12, abs_tol=1e-15)


async def test_a_pipeline_exports_one_observation_per_export() -> None:
    registry = CollectorRegistry()
    sink = MemorySink()
    cfg = PipelineConfig.load(defaults={"linger_s": 0.0}, close_timeout_s=5.0)
    src = source("engine-0")
    async with Pipeline([sink], cfg, registry=registry) as pipe:
        for i in range(7):
            assert await pipe.put(make_batch(src, i, 1))
            for _ in range(3):  # let the sink task wait again (direct hand-offs, see put())
                await asyncio.sleep(0)
        assert await pipe.flush(5)
    got = samples(registry)
    labels = {"pipeline": cfg.name, "sink": sink.name}
    exports = sink.export_calls
    assert exports > 1
    assert registry.get_sample_value(f"{NAME}_count", labels) == exports
    assert got[(f"{NAME}_bucket", "+Inf")] == exports
    assert sorted(le for name, le in got if name == f"{NAME}_bucket") == sorted(
        [*(str(b) for b in LATENCY_BUCKETS), "+Inf"]
    )
    text = generate_latest(registry).decode()
    assert f'{NAME}_bucket{{le="0.0001",pipeline="{cfg.name}",sink="{sink.name}"}}' in text


@pytest.mark.parametrize("names", [("one", "two"), ("same", "same")])
async def test_series_per_pipeline_name_kept_after_close(names: tuple[str, str]) -> None:
    """Pipelines sharing a registry keep one series per (pipeline, sink) name, and a closed
    pipeline's series stays (a later pipeline of the same name adds to it)."""
    registry = CollectorRegistry()
    src = source("engine-0")
    exports = []
    for k, name in enumerate(names):
        sink = MemorySink(name="mem")
        cfg = PipelineConfig.load(defaults={"linger_s": 0.0}, name=name, close_timeout_s=5.0)
        async with Pipeline([sink], cfg, registry=registry) as pipe:
            for i in range(k + 2):
                assert await pipe.put(make_batch(src, 10 * k + i, 1))
            assert await pipe.flush(5)
        exports.append(sink.export_calls)
    assert min(exports) >= 1
    value = registry.get_sample_value
    if names[0] == names[1]:
        assert value(f"{NAME}_count", {"pipeline": "same", "sink": "mem"}) == sum(exports)
    else:
        assert value(f"{NAME}_count", {"pipeline": "one", "sink": "mem"}) == exports[0]
        assert value(f"{NAME}_count", {"pipeline": "two", "sink": "mem"}) == exports[1]

"""The issue's bar on both public Mooncake traces, at 8 workers x 5,859 blocks, with default
options: the adaptive kv router reaches >= 0.9x the hit ratio of one global LRU cache of the
same total size, keeps the load imbalance <= 1.25, and the index predicts every reuse."""

from __future__ import annotations

import asyncio

import pytest

from kvstream.cli.replay_run import ReplayOptions, load_rows, run_replay


@pytest.mark.slow
@pytest.mark.parametrize("trace", ["conversation", "synthetic"])
def test_default_router_is_within_10_percent_of_a_global_lru(trace: str) -> None:
    base = ReplayOptions(trace=trace, timeline_points=0)
    rows = load_rows(base)
    kv = asyncio.run(run_replay(base, rows=rows))
    shared = asyncio.run(run_replay(ReplayOptions(trace=trace, router="global-lru"), rows=rows))
    assert kv.requests == shared.requests == len(rows)  # nothing unservable at this size
    assert kv.ceiling_blocks == shared.ceiling_blocks
    assert kv.hit_ratio >= 0.9 * shared.hit_ratio, (kv.hit_ratio, shared.hit_ratio)
    assert kv.imbalance <= 1.25
    assert kv.prediction_accuracy == 1.0
    assert kv.hit_ratio <= kv.ceiling_ratio <= 1.0

"""The replay hands its workers' deferred batches to the memory sink as columns and the index
applies those columns: no event model is built, and the replay's every result (routing, hits,
index contents) equals the one where the workers' batches are built as models."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvstream.cache import KVCacheManager
from kvstream.cli.replay_run import ReplayOptions, run_replay
from kvstream.events.columns import ColumnBatch
from kvstream.events.deferred import DeferredBatch


def _summary(result: Any) -> dict[str, Any]:
    out = result.as_dict()
    for timing in ("wall_s", "requests_per_s"):
        out.pop(timing)
    return dict(out)


@pytest.mark.parametrize("key_mode", ["engine", "tokens", "dynamo"])
def test_replay_from_columns_equals_replay_from_models(
    key_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = ReplayOptions(trace="conversation", limit=250, key_mode=key_mode)
    built: list[int] = []
    to_batch = ColumnBatch.to_batch
    materialize = DeferredBatch.materialize

    def count_to_batch(self: ColumnBatch) -> Any:
        built.append(1)
        return to_batch(self)

    def count_materialize(self: DeferredBatch) -> Any:
        built.append(1)
        return materialize(self)

    with monkeypatch.context() as m:
        m.setattr(ColumnBatch, "to_batch", count_to_batch)
        m.setattr(DeferredBatch, "materialize", count_materialize)
        columns = asyncio.run(run_replay(opts))
    assert built == []
    # the workers' batches as models (what the replay published before)
    monkeypatch.setattr(KVCacheManager, "flush_events_deferred", KVCacheManager.flush_events)
    models = asyncio.run(run_replay(opts))
    assert columns.batches == models.batches > 200
    assert _summary(columns) == _summary(models)

"""The C loop of ``deferred_columns`` (``_tokens_native.deferred_rows``) against the Python one.

For any emitter history (every op of the emitter tests, blocks with attributes and
multimodal keys that go through the model), the columns of a deferred batch are the same
with the C loop and without it, and equal ``publish_columns`` of the model; the C loop reads
the plain records itself and leaves every other record to Python without appending any of it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_deferred_columns import EXTRA_OPS, deferred_pairs, same_columns
from test_emitter_trusted_batch import OPS

from kvstream.codec import AvroCodec
from kvstream.events import deferred_columns as dc
from kvstream.events.columns import ColumnBatch, publish_columns
from kvstream.events.deferred import BlockRun, DeferredBatch

pytestmark = pytest.mark.skipif(
    dc._native_rows() is None, reason="the C loop is not built (or KVSTREAM_NO_NATIVE)"
)


@contextlib.contextmanager
def python_rows() -> Iterator[None]:
    saved = dc._NATIVE_ROWS
    dc._NATIVE_ROWS = None
    try:
        yield
    finally:
        dc._NATIVE_ROWS = saved


def _columns_in_c(batch: DeferredBatch) -> ColumnBatch:
    """``batch.columns()``, checking that the C loop read its records."""
    calls: list[int] = []
    rows = dc._NATIVE_ROWS

    def counted(*args: Any) -> int:
        calls.append(1)
        return int(rows(*args))

    dc._NATIVE_ROWS = counted
    try:
        cols = batch.columns()
    finally:
        dc._NATIVE_ROWS = rows
    assert calls
    return cols


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(st.one_of(OPS, EXTRA_OPS), min_size=1, max_size=60),
    capacity=st.sampled_from([3, 1024]),
)
def test_c_and_python_loops_build_the_same_columns(
    ops: list[tuple[Any, ...]], capacity: int
) -> None:
    codec = AvroCodec()
    for da, db in deferred_pairs(ops, capacity):
        native = _columns_in_c(da)
        with python_rows():
            python = da.columns()
        same_columns(native, python)
        assert not da.materialized
        same_columns(native, publish_columns(db.materialize()))
        assert codec.encode(native) == codec.encode(db.materialize())


def _records() -> list[dict[str, Any]]:
    run = BlockRun()
    run.hashes += [b"\x01" * 8, b"\x02" * 8]
    run.tokens.append(_ids(range(32), 2))
    return [
        {
            "event_id": 1,
            "window_size": 0,
            "data": {"type": "stored", "parent_hash": None, "blocks": run},
        },
        {
            "event_id": 2,
            "window_size": 0,
            "hash_algo": "v2_sha256_64",
            "data": {"type": "removed", "block_hashes": (b"\x01" * 8,), "cache_level": None},
        },
    ]


def _ids(ids: Any, k: int) -> tuple[Any, int]:
    from kvstream._types import TokenIds

    return TokenIds(ids), k


def _native(records: list[dict[str, Any]], start: int = 0) -> tuple[int, tuple[list[Any], ...]]:
    columns: tuple[list[Any], ...] = ([], [], [], [], [], [], [])
    raws: list[bytes] = []
    rows = dc._native_rows()
    i = rows(records, start, columns, raws, BlockRun, dc._DEFAULT_ALGO, dc._DEFAULT_GROUP)
    return i, (*columns, raws)


def test_plain_records_are_read_in_c() -> None:
    i, cols = _native(_records())
    assert i == 2
    event_ids, kinds, algos, groups, windows, payloads, extra, raws = cols
    assert event_ids == [1, 2]
    assert kinds == [1, 2]
    assert algos == [dc._DEFAULT_ALGO, "v2_sha256_64"]
    assert groups == [dc._DEFAULT_GROUP] * 2
    assert windows == [0, 0]
    assert payloads == [(None, [b"\x01" * 8, b"\x02" * 8], 0, 16), ([b"\x01" * 8], None)]
    assert extra == [([16, 16], None)]
    assert b"".join(raws) == _ids(range(32), 2)[0].raw


_LEFT = [
    lambda r: r[1]["data"].update(block_hashes=()),  # an empty removal: validated
    lambda r: r[1]["data"].update(type="cleared"),
    lambda r: r[1]["data"].pop("cache_level"),
    lambda r: r[1].pop("window_size"),
    lambda r: r[1].update(data=[]),
    lambda r: r[0]["data"]["blocks"].attrs.update({0: {"cache_level": 1}}),
    lambda r: r[0]["data"]["blocks"].tokens.append((_ids(range(4), 1)[0], 0)),  # k = 0
    lambda r: r[0]["data"]["blocks"].tokens.append((_ids(range(4), 1)[0], True)),
    lambda r: r[0]["data"]["blocks"].tokens.append(b"\x00" * 4),  # no raw
    lambda r: r[0]["data"].update(blocks=[]),
]


@pytest.mark.parametrize("change", range(len(_LEFT)))
def test_other_records_are_left_to_python_untouched(change: int) -> None:
    records = _records()
    _LEFT[change](records)
    at = 1 if change < 5 else 0
    i, cols = _native(records)
    assert i == at
    assert all(len(c) == (1 if at else 0) for c in cols[:6])
    assert len(cols[6]) == len(cols[7]) == (1 if at else 0)  # record 0's extra and bytes


def test_plain_rows_are_not_tracked_by_the_cyclic_gc() -> None:
    # bytes, ints and None only: no cycle possible, and ~4 tracked containers per event
    # would trigger full GC passes while a fleet's columns wait to be encoded
    _, cols = _native(_records())
    payloads, extra = cols[5], cols[6]
    for p in payloads:
        assert not gc.is_tracked(p)
        assert not gc.is_tracked(p[0] if isinstance(p[0], list) else p[1])
    assert not gc.is_tracked(extra[0])
    assert not gc.is_tracked(extra[0][0])
    records = _records()
    records[1]["data"]["block_hashes"] = ([b"\x01" * 8],)  # a tracked item keeps it tracked
    _, cols = _native(records)
    assert gc.is_tracked(cols[5][1])

"""Snapshots: a restored index (plus the rest of the stream) equals one built from the start;
the file format is versioned, checksummed and written atomically."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from index_support import Producer, tokens

from kvstream.events.model import EventBatch
from kvstream.index import PrefixIndex, SnapshotError, load_snapshot, save_snapshot
from kvstream.index.snapshot import decode_snapshot, encode_snapshot

REQS = [tokens(8, seed=1) + tokens(12, seed=s) for s in range(2, 6)]

step = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 3), st.integers(0, 4), st.integers(0, 2)),
    st.tuples(st.just("remove"), st.integers(0, 3), st.integers(0, 4), st.integers(0, 2)),
    st.tuples(st.just("orphan"), st.integers(0, 3), st.integers(1, 4), st.integers(0, 2)),
    st.tuples(st.just("move"), st.integers(0, 3), st.integers(0, 4), st.integers(0, 2)),
    st.tuples(st.just("clear"), st.just(0), st.just(0), st.integers(0, 1)),
    st.tuples(st.just("gap"), st.just(0), st.just(0), st.integers(1, 3)),
    st.tuples(st.just("lost"), st.just(0), st.just(0), st.integers(1, 3)),
    st.tuples(st.just("restart"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("dup"), st.just(0), st.just(0), st.just(0)),
)


def build_stream(steps: list[tuple[int, tuple[str, int, int, int]]]) -> list[EventBatch]:
    """Batches of three workers (two groups each) following ``steps``."""
    producers = [Producer(f"w{i}", rank=i % 2) for i in range(3)]
    incarnations = [1, 1, 1]
    out: list[EventBatch] = []
    for p in producers:
        out.append(p.batch(p.created(), p.created(group=1, capacity=(10, 20))))
    for w, (kind, r, i, x) in steps:
        p = producers[w]
        hs = p.chain(REQS[r])
        if kind == "store":
            out.append(p.batch(p.stored(hs[: i + 1], level=x)))
        elif kind == "remove":
            out.append(p.batch(p.removed([hs[i]], level=x or None)))
        elif kind == "orphan":
            out.append(p.batch(p.stored(hs[i:], parent=hs[i - 1], group=x % 2)))
        elif kind == "move":
            out.append(p.batch(p.updated(hs[i], x, (x + 1) % 3)))
        elif kind == "clear":
            out.append(p.batch(p.cleared(group=x)))
        elif kind == "gap":
            p.skip(x)
            out.append(p.batch(p.stored(hs[:1])))
        elif kind == "lost":
            out.append(p.batch(p.lost(x)))
        elif kind == "restart":
            incarnations[w] += 1
            p.restart(incarnations[w])
            out.append(p.batch(p.created()))
        elif out:
            out.append(out[-1])  # at-least-once redelivery
    return out


def apply_all(idx: PrefixIndex, batches: list[EventBatch]) -> PrefixIndex:
    for b in batches:
        idx.apply(b)
    return idx


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 2), step), max_size=40), st.data())
def test_restored_index_equals_one_rebuilt_from_the_start(
    steps: list[tuple[int, tuple[str, int, int, int]]], data: st.DataObject
) -> None:
    stream = build_stream(steps)
    cut = data.draw(st.integers(0, len(stream)))
    full = apply_all(PrefixIndex(), stream)
    first = apply_all(PrefixIndex(), stream[:cut])
    snap = decode_snapshot(encode_snapshot(first, {"kind": "test", "offset": cut}))
    assert snap.positions == {"kind": "test", "offset": cut}
    assert snap.index.canonical_state() == first.canonical_state()
    resumed = apply_all(snap.index, stream[snap.positions["offset"] :])  # type: ignore[index]
    resumed.check()
    assert resumed.canonical_state() == full.canonical_state()
    probe = tokens(8, seed=1) + tokens(12, seed=2)
    assert resumed.match(probe).as_list() == full.match(probe).as_list()


def test_save_and_load_a_file(tmp_path: Path) -> None:
    p = Producer()
    idx = PrefixIndex(default_tokens_per_block=4)
    idx.apply(p.batch(p.created(), p.stored(p.chain(REQS[0]))))
    path = tmp_path / "idx.snap"
    n = save_snapshot(
        path, idx, {"kind": "file", "file": "a", "offset": 7, "skip": 1}, {"who": "t"}
    )
    assert n == path.stat().st_size
    snap = load_snapshot(path)
    assert snap.meta == {"who": "t"}
    assert snap.positions is not None
    assert snap.index.default_tokens_per_block == 4
    assert snap.index.canonical_state() == idx.canonical_state()
    assert [p.name for p in tmp_path.iterdir()] == ["idx.snap"]  # no temporary left behind


def test_snapshot_problems_raise_snapshot_error(tmp_path: Path) -> None:
    idx = PrefixIndex()
    p = Producer()
    idx.apply(p.batch(p.created(), p.stored(p.chain(REQS[0]))))
    data = encode_snapshot(idx)
    with pytest.raises(SnapshotError, match="no snapshot"):
        load_snapshot(tmp_path / "missing")
    with pytest.raises(SnapshotError, match="checksum"):
        decode_snapshot(data[:-40] + data[-39:])
    with pytest.raises(SnapshotError, match="checksum"):
        decode_snapshot(data[:-1])
    with pytest.raises(SnapshotError, match="magic"):
        decode_snapshot(b"X" + data[1:])
    bad_version = data[:8] + (99).to_bytes(2, "little") + data[10:]
    with pytest.raises(SnapshotError, match="version 99"):
        decode_snapshot(bad_version)
    with pytest.raises(SnapshotError, match="too short"):
        decode_snapshot(b"KVSIDX")


def test_a_failed_write_keeps_the_old_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    idx = PrefixIndex()
    path = tmp_path / "idx.snap"
    save_snapshot(path, idx, {"kind": "x", "offset": 1})

    def boom(*a: object, **k: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        save_snapshot(path, idx, {"kind": "x", "offset": 2})
    monkeypatch.undo()
    assert load_snapshot(path).positions == {"kind": "x", "offset": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["idx.snap"]

"""The index's C paths against their Python references: ingest into the mask map, the depth
search, match results (from cached plans), on random streams."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from native_parts import native_part

from kvstream.codec import AvroCodec
from kvstream.events.model import (
    Cleared,
    Created,
    EventBatch,
    EventDiff,
    KVCacheEvent,
    Lost,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
    Updated,
)
from kvstream.index import DomainKey, MatchResult, PrefixIndex, WorkerKey
from kvstream.index import domain as domain_module
from kvstream.index import table as table_module
from kvstream.index.domain import MaskMap, prefix_depths
from kvstream.index.sources import decode_message

native = native_part("kvstream.index._table_native")

ALGO = "blake3_64"
DOMAIN = DomainKey(ALGO, 4, 0)
# two chains sharing a prefix, so stores branch, and matches find many depths
CHAINS = [[bytes([c, i]) * 4 for i in range(8)] for c in (1, 2)]
for i in range(3):
    CHAINS[1][i] = CHAINS[0][i]
POOL = sorted({h for c in CHAINS for h in c})
_hash = st.sampled_from(POOL)


@st.composite
def _event(draw: st.DrawFn, eid: int) -> KVCacheEvent:
    kind = draw(st.sampled_from(["stored"] * 4 + ["removed"] * 2 + ["updated", "cleared"]))
    data: Any
    if kind == "stored":
        chain = draw(st.sampled_from(CHAINS))
        start = draw(st.integers(0, 7))
        end = draw(st.integers(start + 1, 8))
        level = draw(st.integers(0, 2))
        parent = chain[start - 1] if start else None
        if draw(st.integers(0, 9)) == 0:
            parent = draw(st.one_of(st.none(), _hash))  # a wrong or unknown parent
        data = Stored(
            parent_hash=parent,
            blocks=tuple(
                StoredBlock(block_hash=h, token_ids=[1, 2, 3, 4], cache_level=level)
                for h in chain[start:end]
            ),
        )
    elif kind == "removed":
        data = Removed(
            block_hashes=tuple(draw(st.lists(_hash, min_size=1, max_size=5))),
            cache_level=draw(st.sampled_from([None, 0, 0, 1])),
        )
    elif kind == "updated":
        diff = EventDiff(old_value=draw(st.integers(0, 2)), new_value=draw(st.integers(0, 2)))
        data = Updated(block_hash=draw(_hash), cache_level=diff)
    else:
        data = Cleared()
    return KVCacheEvent(event_id=eid, hash_algo=ALGO, window_size=64, data=data)


@st.composite
def streams(draw: st.DrawFn, max_workers: int = 70) -> list[EventBatch]:
    """Batches of up to ``max_workers`` workers (slots past 64 widen the masks), some stale
    (a lost marker), interleaved."""
    out = []
    for w in range(draw(st.integers(1, max_workers))):
        src = SourceId(instance_id=f"w{w}", attention_dp_rank=0, incarnation=1)
        evs = [
            KVCacheEvent(
                event_id=0,
                hash_algo=ALGO,
                window_size=64,
                data=Created(num_blocks_per_cache_level=(64, 64, 64), tokens_per_block=4),
            )
        ]
        n = draw(st.integers(0, 6))
        for eid in range(1, n + 1):
            evs.append(draw(_event(eid)))
        if draw(st.integers(0, 9)) == 0:
            evs.append(
                KVCacheEvent(
                    event_id=n + 1,
                    hash_algo=ALGO,
                    window_size=64,
                    data=Lost(first_event_id=n + 1, count=1, reason="overflow"),
                )
            )
        for i in range(0, len(evs), 3):
            out.append(EventBatch(source=src, ts_ns=1, events=tuple(evs[i : i + 3])))
    return draw(st.permutations(out)) if draw(st.booleans()) else out


def _python_only(m: pytest.MonkeyPatch) -> None:
    m.setattr(table_module, "_native", None)
    m.setattr(domain_module, "_native", None)


def _index(batches: list[Any], use_native: bool, monkeypatch: pytest.MonkeyPatch) -> PrefixIndex:
    with monkeypatch.context() as m:
        if not use_native:
            _python_only(m)
        idx = PrefixIndex()
        idx.apply_many(batches)
        idx.check()
        return idx


def _queries() -> list[list[bytes]]:
    return [c[:n] for c in CHAINS for n in (1, 3, 5, 8)] + [[POOL[0]], []]


def _matches(idx: PrefixIndex, use_native: bool, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    with monkeypatch.context() as m:
        if not use_native:
            _python_only(m)
        out: list[Any] = []
        for q in _queries():
            out.append(idx.match_hashes(DOMAIN, q))
            out.append(idx.match_hashes(DOMAIN, q, include_stale=True))
            out.append(_match(idx, q))
        return out


def _match(idx: PrefixIndex, hashes: list[bytes], **kw: Any) -> MatchResult:
    return idx.match(
        [0] * (4 * len(hashes) + 1),
        block_hashes=hashes,
        hash_algo=ALGO,
        tokens_per_block=4,
        **kw,
    )


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(stream=streams())
def test_native_and_python_paths_build_and_match_the_same_index(
    stream: list[EventBatch], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Columns decoded from Avro, applied with the C loops and with the Python loops:
    identical state, counters included, identical masks, and identical matches (the C search
    against the Python search)."""
    codec = AvroCodec()
    cols = [decode_message(codec, codec.encode(b)).columns for b in stream]
    fast = _index(cols, True, monkeypatch)
    slow = _index(cols, False, monkeypatch)
    assert fast.canonical_state() == slow.canonical_state()
    masks = {k: d.masks.as_dict() for k, d in fast._domains.items()}
    assert masks == {k: d.masks.as_dict() for k, d in slow._domains.items()}
    assert _matches(fast, True, monkeypatch) == _matches(slow, False, monkeypatch)
    # the Python search over the C-built masks, and the C search over the Python-built ones
    assert _matches(fast, False, monkeypatch) == _matches(slow, True, monkeypatch)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(stream=streams(8), cut=st.integers(0, 10_000), seed=st.integers(0, 3))
def test_cached_match_plans_follow_every_change(
    stream: list[EventBatch], cut: int, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """match() between batches (its plans cached across calls) answers as an index that
    never matched before, after every batch, with explicit candidate lists too (unknown and
    repeated workers included), and after resync, mark_stale and forget."""
    idx = PrefixIndex()
    applied: list[EventBatch] = []
    extra = [WorkerKey("nobody", 0), WorkerKey("w0", 0), WorkerKey("w0", 0), ("w1", 0)]

    def same() -> None:
        fresh = _index(applied, True, monkeypatch)
        for i, q in enumerate(_queries()):
            assert _match(idx, q) == _match(fresh, q)
            if (i + seed) % 3 == 0:
                assert _match(idx, q, workers=extra) == _match(fresh, q, workers=extra)

    for i, b in enumerate(stream):
        idx.apply(b)
        applied.append(b)
        if i % 4 == seed:
            same()
    same()
    workers = idx.workers()
    if workers:
        w = workers[cut % len(workers)]
        idx.mark_stale(w, "health check")
        got = _match(idx, CHAINS[0]).get(w)
        assert got is not None
        assert not got.trusted
        idx.resync(w)
        got = _match(idx, CHAINS[0]).get(w)
        assert got is not None
        assert got.matched_blocks == 0
        # trusted again, unless the worker cannot be matched at all (the stream never
        # advertised what it needs): never still stale from the health check
        assert got.trusted or got.note in (
            "no layer group 0",
            "block size not advertised",
            "hash algorithm unknown",
        )
        idx.forget(w)
        assert _match(idx, CHAINS[0]).get(w) is None
        got = _match(idx, CHAINS[0], workers=[w]).get(w)
        assert got is not None
        assert got.note == "unknown worker"


@st.composite
def mask_maps(draw: st.DrawFn) -> tuple[MaskMap, Any, dict[bytes, int]]:
    """A MaskMap and the C MaskMap built by the same random adds and discards (slots up to
    140), and the dict of ints they must equal."""
    masks = MaskMap()
    cmasks = native.MaskMap()
    want: dict[bytes, int] = {}
    for key, slot, add in draw(
        st.lists(st.tuples(_hash, st.integers(0, 140), st.booleans()), max_size=80)
    ):
        masks.reserve(slot)
        cmasks.reserve(slot)
        if add:
            masks.add(key, slot)
            cmasks.add(key, slot)
            want[key] = want.get(key, 0) | 1 << slot
        else:
            masks.discard(key, slot)
            cmasks.discard(key, slot)
            m = want.get(key, 0) & ~(1 << slot)
            if m:
                want[key] = m
            else:
                want.pop(key, None)
    return masks, cmasks, want


@given(mm=mask_maps(), hashes=st.lists(_hash, max_size=20), allowed=st.integers(0, 1 << 141))
def test_mask_map_and_the_c_search_equal_the_reference(
    mm: tuple[MaskMap, Any, dict[bytes, int]], hashes: list[bytes], allowed: int
) -> None:
    """A MaskMap reads as the dict of ints its updates describe, and the C search gives the
    Python search's pairs over it, for any masks (shrinking along the chain or not) and any
    allowed set."""
    masks, cmasks, want = mm
    assert masks.as_dict() == want == cmasks.as_dict()
    assert len(masks) == len(want) == len(cmasks)
    for a in (None, allowed):
        want_pairs = prefix_depths(hashes, want, a)
        raw = None if a is None else (a & ((1 << 8 * cmasks.width) - 1))
        raw_b = None if raw is None else raw.to_bytes(cmasks.width, "little")
        assert native.prefix_depths(cmasks, hashes, raw_b) == want_pairs
        with pytest.raises(TypeError):  # the C search reads only its own map
            native.prefix_depths(masks, hashes, raw_b)
        per_slot: dict[int, int] = {}
        for mask, d in want_pairs:
            for s in range(mask.bit_length()):
                if mask >> s & 1 and d > per_slot.get(s, 0):
                    per_slot[s] = d
        assert native.slot_depths(cmasks, hashes, raw_b) == sorted(per_slot.items())


def test_mask_map_widens_keeping_every_bit() -> None:
    masks = MaskMap()
    masks.add(b"a", 3)
    masks.add(b"b", 63)
    masks.reserve(200)
    masks.add(b"b", 200)
    assert masks.width == 32
    assert masks.as_dict() == {b"a": 1 << 3, b"b": 1 << 63 | 1 << 200}
    masks.discard(b"a", 3)
    masks.discard(b"b", 63)
    masks.discard(b"zz", 1)
    assert masks.as_dict() == {b"b": 1 << 200}
    masks.add(b"c", 0)  # reuses the freed entry, cleared
    assert masks.as_dict() == {b"b": 1 << 200, b"c": 1}

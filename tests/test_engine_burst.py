"""Engine payloads read in bursts: several consecutive payloads of one stream into one column
batch (``EngineStream.burst``, the C reader's ``into`` form), and ``EngineSource`` handing a
drained burst of frames over as one item.

A burst must give exactly what the payloads give one by one (``payload_columns``): the same
events, ids, windows, tokens and token layouts, the same stream state after, and, applied to
an index, the same index state and counters (but ``batches``: one per burst). A payload the
burst refuses (outside the one-call subset, or naming another rank) changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from engine_publisher import TestEnginePublisher, free_ports, stored_payload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engines_wire_paths import payloads

from kvstream.engines import vllm as wire
from kvstream.engines.endpoint import DIALECTS
from kvstream.engines.stream import EngineStream
from kvstream.errors import InteropError
from kvstream.index import PrefixIndex
from kvstream.index.sources.engine import EngineSource

GOLDEN = Path(__file__).parent / "data" / "golden"

needs_c = pytest.mark.skipif(
    wire._wire_native is None, reason="kvstream.engines._wire_native is not built"
)
PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _stream(windows: bool = False) -> EngineStream:
    s = EngineStream("vllm@h:1", 0, "vllm_sha256_cbor_64", clock_ns=lambda: 7)
    if windows:  # groups already known, as after earlier batches
        s.resume({"incarnation": 7, "next_id": 5, "windows": {"0": 64, "3": 9}})
    return s


def _joined(batches: list[Any]) -> tuple[Any, ...]:
    """The columns of ``batches`` one after the other, token layouts counted from the
    first batch's tokens (what one batch holding them all has)."""
    ids: list[Any] = []
    kinds: list[Any] = []
    groups: list[Any] = []
    windows: list[Any] = []
    pls: list[Any] = []
    extra: list[Any] = []
    layout: list[Any] = []
    algos: list[Any] = []
    tokens = b""
    for c in batches:
        base = len(tokens) // 4
        ids += c.event_ids
        kinds += c.kinds
        groups += c.group_ids
        windows += c.window_sizes
        pls += c.payloads
        extra += c.stored_extra
        algos += c.hash_algos
        layout += [None if x is None else (x[0] + base, x[1]) for x in c.token_layout]
        tokens += c.tokens
    return ids, kinds, groups, windows, pls, extra, layout, algos, tokens


def _burst_of(stream: EngineStream, frames: list[bytes], *rank: int | None) -> tuple[Any, int]:
    burst = stream.burst(*rank)
    assert burst is not None
    taken = 0
    for p in frames:
        if not burst.add(p):
            break
        taken += 1
    assert burst.count == taken
    return (burst.finish() if taken else None), taken


@needs_c
@PROPS
@given(frames=st.lists(payloads, min_size=1, max_size=5), windows=st.booleans())
def test_a_burst_is_its_payloads_one_by_one(frames: list[bytes], windows: bool) -> None:
    one, many = _stream(windows), _stream(windows)
    before = many.state()
    got, taken = _burst_of(many, frames)
    want = []
    for p in frames[:taken]:
        cols = one._native_columns(p, wire._wire_native)
        assert cols is not None  # the burst took it: the one-payload C call takes it
        want.append(cols)
    if taken < len(frames):  # the first it refused: the one-payload call refuses it too
        assert one._native_columns(frames[taken], wire._wire_native) is None
    if not taken:
        assert got is None
        assert many.state() == before
        return
    assert _joined([got]) == _joined(want)
    assert got.token_layout == _joined(want)[6]
    assert (many.state(), many.events) == (one.state(), one.events)


@needs_c
def test_a_refused_payload_leaves_the_burst_and_the_windows_as_they_were() -> None:
    def stored(h: int, **kw: Any) -> dict[str, Any]:
        return {
            "type": "BlockStored",
            "block_hashes": [h],
            "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4],
            "block_size": 4,
            "lora_id": None,
            "medium": "GPU",
        } | kw

    first = msgspec.msgpack.encode([1.0, [stored(1)], 0])
    # a new group's window, then an event the C reader leaves to Python (a LoRA id): the
    # window it had already set must not stay
    mixed = msgspec.msgpack.encode(
        [2.0, [stored(2, group_idx=5, sliding_window_size=32), stored(3, lora_id=7)], 0]
    )
    other_rank = msgspec.msgpack.encode([3.0, [stored(4)], 1])
    s = _stream()
    burst = s.burst(0)
    assert burst is not None
    assert burst.add(first)
    state = [list(x) if isinstance(x, list) else bytes(x) for x in burst._into]
    known = dict(burst._known)
    assert not burst.add(mixed)
    assert not burst.add(other_rank)  # names rank 1, the burst rank 0
    assert not burst.add(b"\x93garbage")
    assert [list(x) if isinstance(x, list) else bytes(x) for x in burst._into] == state
    assert burst._known == known
    assert 5 not in burst._known
    assert s.state()["next_id"] == 0  # nothing committed before finish
    cols = burst.finish()
    assert cols.event_ids == [0]
    assert s.state()["next_id"] == 1
    # what it refused, the one-payload path reads
    assert s.payload_columns(mixed).event_ids == [1, 2]


def _index_state(index: PrefixIndex) -> tuple[Any, Any]:
    """The index's state and each worker's counters, but ``batches`` (one per burst)."""
    stats = {k: dataclasses.asdict(s.stats) | {"batches": 0} for k, s in index._sources.items()}
    state = index.canonical_state()
    for worker in state.values():
        worker["stats"] = worker["stats"] | {"batches": 0}
    return state, stats


@pytest.mark.parametrize("mode", ["engine", "dynamo"])
def test_captured_frames_in_bursts_give_the_index_what_they_give_one_by_one(mode: str) -> None:
    n = 0
    for capture in sorted(GOLDEN.glob("*/*.json")):
        doc = json.loads(capture.read_text())
        package = doc["producer"]["package"]
        algo = "sglang_sha256_64" if package == "sglang" else "vllm_sha256_cbor_64"
        if "-bytes-" in capture.name:
            algo = "vllm_sha256_cbor"
        frames = [bytes.fromhex(step["frames"][2]) for step in doc["live"]]
        dialect = DIALECTS[package]
        one = EngineStream(package, 0, algo, clock_ns=lambda: 1)
        many = EngineStream(package, 0, algo, clock_ns=lambda: 1)
        by_one, by_burst = PrefixIndex(key_mode=mode), PrefixIndex(key_mode=mode)
        for p in frames:
            with contextlib.suppress(InteropError):
                by_one.apply(one.payload_columns(p, dialect))
        i = 0
        while i < len(frames):
            burst = many.burst()
            while burst is not None and i < len(frames) and burst.add(frames[i]):
                i += 1
            if burst is not None and burst.count:
                n += burst.count
                by_burst.apply(burst.finish())
                continue
            with contextlib.suppress(InteropError):  # the one the burst refused
                by_burst.apply(many.payload_columns(frames[i], dialect))
            i += 1
        assert _index_state(by_burst) == _index_state(by_one), capture.name
        assert many.state() == one.state()
    if wire._wire_native is not None:
        assert n >= 5


# ------------------------------------------------------------------ EngineSource over ZMQ


async def _drain(src: EngineSource, frames: int, timeout: float = 10.0) -> list[Any]:
    out: list[Any] = []
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while sum(item.count for item in out) < frames:
        item = await src.read(max(0.0, end - loop.time()))
        if item is None:
            raise AssertionError(f"only {sum(i.count for i in out)} of {frames} arrived")
        out.append(item)
    return out


async def _wait_queued(src: EngineSource, n: int) -> None:
    for _ in range(200):  # until the follower has read them all (they then form bursts)
        if len(src.subscriber._queue) >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the frames did not arrive")


@needs_c
async def test_engine_source_hands_a_drained_burst_over_as_one_item() -> None:
    port, replay = free_ports(2)
    engine = TestEnginePublisher(port, replay)
    try:
        src = EngineSource(
            f"vllm://127.0.0.1:{port}?replay={replay}&instance=w",
            rank_from_events=True,
            columns=True,
        )
        await src.start()
        await asyncio.sleep(0.3)
        frames = [stored_payload(i) for i in range(10)]
        frames[4] = stored_payload(4, lora=3)  # outside the C subset: ends a burst, read alone
        frames[7] = stored_payload(7, rank=1)  # another rank: ends a burst, goes to rank 1's stream
        for p in frames:
            engine.publish(p)
        engine.publish(stored_payload(10), send=False)  # dropped by the PUB: a gap, replayed
        engine.publish(stored_payload(11))
        await _wait_queued(src, 11)
        items = await _drain(src, 12)
        await src.aclose()
    finally:
        engine.close()
    assert [i.count for i in items] == [4, 1, 2, 1, 4]
    assert src.stats.batches == 12
    got = [(i.columns.attention_dp_rank, i.columns.event_ids) for i in items]
    assert got == [
        (0, [0, 1, 2, 3]),
        (0, [4]),
        (0, [5, 6]),
        (1, [0]),  # rank 1's stream
        (0, [7, 8, 9, 10]),  # rank 0 again, the replayed batch in its place
    ]
    assert src.subscriber.stats[0].replayed == 1
    assert src.checkpoint()["engine_seq"] == {"0": 11}
    # applied, the items give the index what the frames one by one give it
    by_item, by_frame = PrefixIndex(key_mode="dynamo"), PrefixIndex(key_mode="dynamo")
    for item in items:
        by_item.apply(item.columns, item.skipped_ids)
    streams = {r: EngineStream("w", r, "vllm_sha256_cbor_64") for r in (0, 1)}
    rank = 0
    for p in [*frames, stored_payload(10), stored_payload(11)]:
        named = msgspec.msgpack.decode(p)[2]
        rank = rank if named is None else named
        by_frame.apply(streams[rank].payload_columns(p))
    assert _index_state(by_item)[1] == _index_state(by_frame)[1]

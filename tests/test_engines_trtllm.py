"""kvstream.engines.trtllm: TensorRT-LLM JSON events <-> kvstream's event model."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvstream._types import TOKEN_ID_MAX, hash_from_hex, hash_from_int
from kvstream.clock import ManualClock
from kvstream.engines.trtllm import (
    TrtllmEventReader,
    from_trtllm_event,
    from_trtllm_events,
    to_trtllm_event,
    to_trtllm_events,
)
from kvstream.errors import ConfigError, InteropError
from kvstream.events.model import (
    CURRENT_SCHEMA_VERSION,
    UNBOUNDED_WINDOW,
    AttentionKind,
    Cleared,
    Created,
    EventBatch,
    EventDiff,
    KVCacheEvent,
    Lost,
    MmKey,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
    Updated,
)

DATA = Path(__file__).parent / "data"
TS = 1_700_000_000_000_000_000
DIGEST_A = bytes(range(32))
DIGEST_B = hashlib.sha256(b"item-b").digest()


def load(name: str) -> dict[str, Any]:
    with (DATA / name).open() as f:
        return json.load(f)  # type: ignore[no-any-return]


def read(events: Any, **kw: Any) -> list[EventBatch]:
    kw.setdefault("instance_id", "trt-0")
    kw.setdefault("ts_ns", TS)
    return from_trtllm_events(events, **kw)


def v1(value: int) -> bytes:
    return hash_from_int(value)


def v2_keys(parent: bytes | None, blocks: list[list[int | bytes]]) -> list[bytes]:
    """v2_sha256 chain (reference 3.2): SHA-256(parent key || tokens), ints 4-byte LE."""
    key = hashlib.sha256(b"\x00").digest() if parent is None else parent
    out = []
    for block in blocks:
        buf = bytearray(key)
        for t in block:
            buf += t if isinstance(t, bytes) else struct.pack("<I", t)
        key = hashlib.sha256(bytes(buf)).digest()
        out.append(key)
    return out


def engine_tokens(block: StoredBlock, offset: int) -> list[int | bytes]:
    """Undo kvstream's digest-token mapping: the k-th ``offset`` token is the k-th start-0 key."""
    digests = iter(k.hash for k in block.mm_keys if k.start_offset == 0)
    return [next(digests) if t == offset else t for t in block.token_ids]


# --------------------------------------------------------------------------------------------
# Reference examples (section 1.5), verbatim
# --------------------------------------------------------------------------------------------


class TestReferenceExamples:
    def test_reads_into_one_batch_per_rank(self) -> None:
        events = load("trtllm_reference_examples.json")["events"]
        batches = read(events, tokens_per_block=4, incarnation=7)
        assert [b.source for b in batches] == [
            SourceId(instance_id="trt-0", attention_dp_rank=None, incarnation=7),
            SourceId(instance_id="trt-0", attention_dp_rank=1, incarnation=7),
        ]
        assert all(b.ts_ns == TS and b.schema_version == CURRENT_SCHEMA_VERSION for b in batches)
        created, stored, removed = batches[0].events
        assert created == KVCacheEvent(
            event_id=0,
            hash_algo="v1_block_key",
            window_size=4096,
            data=Created(num_blocks_per_cache_level=(4096, 0), tokens_per_block=4),
        )
        assert stored.data == Stored(
            parent_hash=None,
            blocks=(
                StoredBlock(block_hash=v1(924206229973855), token_ids=[1, 2, 3, 4]),
                StoredBlock(block_hash=v1(6875034662206558884), token_ids=[5, 6]),
            ),
        )
        assert removed.data == Removed(block_hashes=(v1(6875034662206558884),))
        (updated,) = batches[1].events
        assert updated == KVCacheEvent(
            event_id=3,
            hash_algo="v2_sha256",
            layer_group_id=1,
            window_size=128,
            data=Updated(
                block_hash=hash_from_hex(
                    "e432228522a304ab556d66e6e40979ad05575f28b19b554264dd3c6277aaf073"
                ),
                cache_level=EventDiff(old_value=0, new_value=1),
                priority=None,
            ),
        )

    def test_hashes_are_the_reference_vectors(self) -> None:
        vectors = {c["id"]: c["expect"] for c in load("block_hashes.json")["cases"]}
        events = load("trtllm_reference_examples.json")["events"]
        (batch, ranked) = read(events, tokens_per_block=4)
        blocks = batch.events[1].data
        assert isinstance(blocks, Stored)
        assert [b.block_hash for b in blocks.blocks] == [v1(h) for h in vectors["trt-v1-B"]]
        assert isinstance(ranked.events[0].data, Updated)
        assert ranked.events[0].data.block_hash.hex() == vectors["trt-v2-A"][0]

    def test_writes_back_verbatim(self) -> None:
        events = load("trtllm_reference_examples.json")["events"]
        assert to_trtllm_events(read(events, tokens_per_block=4)) == events

    def test_mm_key_example(self) -> None:
        mm_key = load("trtllm_reference_examples.json")["mm_key_v2"]
        event = {
            "event_id": 5,
            "window_size": 64,
            "hash_algo": "v2_sha256",
            "data": {
                "type": "stored",
                "parent_hash": None,
                "blocks": [
                    {
                        "type": "stored_block",
                        "block_hash": "ab" * 32,
                        "tokens": [{"type": "unique_token", "token_id": 1, "token_extra_id": 0}],
                        "mm_keys": [mm_key],
                    }
                ],
            },
        }
        rank, ev = from_trtllm_event(event)
        assert rank is None
        assert isinstance(ev.data, Stored)
        assert ev.data.blocks[0].mm_keys == (
            MmKey(hash=DIGEST_A, start_offset=3, uuid="frontend-h-a"),
        )
        out = to_trtllm_event(ev)
        assert out["data"]["blocks"][0]["mm_keys"] == [mm_key]


# --------------------------------------------------------------------------------------------
# Fixtures with real hashes: V1 C++ features, attention DP, fan-out, V2 multimodal
# --------------------------------------------------------------------------------------------


def test_v1_cpp_features() -> None:
    events = load("trtllm_v1_cpp_features.json")["events"]
    (batch,) = read(events)
    assert batch.source.attention_dp_rank is None
    assert all(e.hash_algo == "v1_block_key" and e.layer_group_id == 0 for e in batch.events)
    j, i, f, c3, uuid_only = (e.data for e in batch.events)
    assert isinstance(j, Stored)
    assert j.blocks[0].block_hash == v1(7023362434702390509)
    assert j.blocks[0].mm_keys == (MmKey(hash=DIGEST_A, start_offset=2),)
    assert isinstance(i, Stored)
    assert i.blocks[0].token_extra_ids == [7, 0, 0, 9]
    assert isinstance(f, Stored)
    assert [b.cache_salt for b in f.blocks] == ["tenant-A", "tenant-A"]
    assert isinstance(c3, Removed)
    assert c3.block_hashes == (v1(10011707017105896989),)  # signed wire form, wrapped
    assert isinstance(uuid_only, Stored)
    (block,) = uuid_only.blocks
    assert (block.priority, block.cache_level) == (80, 1)
    # V1 "uuid replaces hash": the digest is unknown (zero sentinel), the uuid is kept.
    assert block.mm_keys == (MmKey(hash=bytes(32), start_offset=0, uuid="frontend-h-b"),)

    # Written back as V1 shape: unsigned hashes, uuid in place of the hash again.
    out = to_trtllm_events(batch, include_hash_algo=False)
    expected = copy.deepcopy(events)
    expected[3]["data"]["block_hashes"] = [10011707017105896989]
    for e in expected:
        e["layer_group_id"] = 0
    assert out == expected


def test_attention_dp_grouping_and_signed_hashes() -> None:
    events = load("trtllm_attention_dp.json")["events"]
    batches = read(events, tokens_per_block=4)
    assert [b.source.attention_dp_rank for b in batches] == [0, 1]
    assert [e.event_id for e in batches[0].events] == [0, 1, 2, 3]
    assert [e.event_id for e in batches[1].events] == [0, 1, 2]
    assert [e.kind.value for e in batches[1].events] == ["created", "stored", "updated"]
    a64 = v1(16443243144690205867)
    s0, s1 = batches[0].events[1].data, batches[1].events[1].data
    assert isinstance(s0, Stored)
    assert isinstance(s1, Stored)
    assert s0.blocks[0].block_hash == s1.blocks[0].block_hash == a64  # signed == unsigned
    # v2_sha256_64 is the first 8 bytes of the v2_sha256 key (vector C)
    keys = v2_keys(None, [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    chained = batches[0].events[2].data
    assert isinstance(chained, Stored)
    assert chained.parent_hash == keys[0][:8]
    assert [b.block_hash for b in chained.blocks] == [k[:8] for k in keys[1:]]

    out = to_trtllm_events(batches)
    by_rank = [e for e in events if e["attention_dp_rank"] == 0] + [
        e for e in events if e["attention_dp_rank"] == 1
    ]
    expected = copy.deepcopy(by_rank)
    expected[5]["data"]["blocks"][0]["block_hash"] = 16443243144690205867
    assert out == expected


def test_ranks_keep_first_seen_order_and_none_is_its_own_source() -> None:
    def ev(i: int, rank: int | None) -> dict[str, Any]:
        e: dict[str, Any] = {"event_id": i, "window_size": 8, "data": {"type": "cleared"}}
        if rank is not None:
            e["attention_dp_rank"] = rank
        return e

    batches = read([ev(0, 3), ev(0, None), ev(0, 0), ev(1, 3), ev(1, None), {**ev(2, 3)}])
    assert [b.source.attention_dp_rank for b in batches] == [3, None, 0]
    assert [[e.event_id for e in b.events] for b in batches] == [[0, 1, 2], [0, 1], [0]]
    assert read([]) == []
    assert read(iter([ev(0, None)]))[0].events[0].data == Cleared()


def test_fanout_all_cleared() -> None:
    events = load("trtllm_fanout_all_cleared.json")["events"]
    rank0, rank1 = read(events)
    assert [(e.event_id, e.kind.value) for e in rank0.events] == [
        (0, "stored"),
        (1, "stored"),
        (3, "cleared"),  # the last lost id before the next delivered event (4)
        (4, "stored"),
    ]
    assert [(e.event_id, e.kind.value) for e in rank1.events] == [(2, "cleared"), (3, "removed")]
    cleared = rank0.events[2]
    assert (cleared.window_size, cleared.layer_group_id, cleared.hash_algo) == (
        4096,
        0,
        "v1_block_key",
    )
    out = to_trtllm_events([rank0, rank1], include_hash_algo=False)
    assert out[2] == {
        "event_id": 3,
        "data": {"type": "cleared"},
        "window_size": 4096,
        "attention_dp_rank": 0,
        "layer_group_id": 0,
    }


def test_all_cleared_id_and_window_fallbacks() -> None:
    marker = {"data": {"type": "all_cleared"}}
    # nothing known: id 0, window from default_window_size, else UNBOUNDED_WINDOW
    (batch,) = read([marker], default_window_size=512)
    assert (batch.events[0].event_id, batch.events[0].window_size) == (0, 512)
    (batch,) = read([marker])
    assert (batch.events[0].event_id, batch.events[0].window_size) == (0, UNBOUNDED_WINDOW)
    # explicit fields win
    (batch,) = read([{**marker, "event_id": 9, "window_size": 7}], default_window_size=512)
    assert (batch.events[0].event_id, batch.events[0].window_size) == (9, 7)
    # a reader remembers the last id per rank and the largest window across reads
    reader = TrtllmEventReader(instance_id="trt-0", clock=ManualClock(5))
    first = reader.read([{"event_id": 4, "window_size": 64, "data": {"type": "cleared"}}])
    assert first[0].ts_ns == 5
    (later,) = reader.read([marker, marker])
    assert [(e.event_id, e.window_size) for e in later.events] == [(5, 64), (6, 64)]
    # a single event has nothing to number it from
    with pytest.raises(InteropError, match=r"^event\.event_id: missing"):
        from_trtllm_event(marker, default_window_size=4)
    assert from_trtllm_event({**marker, "event_id": 3}).event.window_size == UNBOUNDED_WINDOW
    assert from_trtllm_event({**marker, "event_id": 1, "window_size": 4}).event.data == Cleared()


# --------------------------------------------------------------------------------------------
# V2 multimodal tokens (section 3.3)
# --------------------------------------------------------------------------------------------


class TestMultimodal:
    OFFSET = 1000

    def test_decoding_vectors(self) -> None:
        doc = load("trtllm_v2_multimodal.json")
        assert doc["mm_token_id_offset"] == self.OFFSET
        (batch,) = read(doc["events"], tokens_per_block=4, mm_token_id_offset=self.OFFSET)
        blocks = [b for e in batch.events if isinstance(e.data, Stored) for b in e.data.blocks]
        h, b1, b2 = blocks
        # published mm_keys are taken as is (with the uuid); the digest token becomes OFFSET
        assert h.token_ids == [self.OFFSET, 1001, 1002, 1003]
        assert h.mm_keys == (MmKey(hash=DIGEST_A, start_offset=0, uuid="frontend-h-a"),)
        # empty mm_keys are derived: the reference's test vectors
        assert b1.token_ids == [1003, 7, 1004, 1005]
        assert [(k.hash, k.start_offset) for k in b1.mm_keys] == [(DIGEST_A, 3), (DIGEST_A, 4)]
        assert b2.token_ids == [1006, self.OFFSET, 1001, 9]
        assert [(k.hash, k.start_offset) for k in b2.mm_keys] == [(DIGEST_A, 6), (DIGEST_B, 0)]

    def test_block_hashes_are_still_the_engines(self) -> None:
        doc = load("trtllm_v2_multimodal.json")
        (batch,) = read(doc["events"], tokens_per_block=4, mm_token_id_offset=self.OFFSET)
        blocks = [b for e in batch.events if isinstance(e.data, Stored) for b in e.data.blocks]
        keys = v2_keys(None, [engine_tokens(b, self.OFFSET) for b in blocks])
        assert [b.block_hash for b in blocks] == keys
        assert keys[0].hex() == "a9c37f0e9dc090e0fe39a3a767054abf95e737a4240a2e4d7e6f9c1fffa2c735"

    def test_writes_digest_tokens_back(self) -> None:
        doc = load("trtllm_v2_multimodal.json")
        batches = read(doc["events"], tokens_per_block=4, mm_token_id_offset=self.OFFSET)
        out = to_trtllm_events(batches, mm_token_id_offset=self.OFFSET)
        expected = copy.deepcopy(doc["events"])
        derived = {
            2: [(DIGEST_A, 3), (DIGEST_A, 4)],
            3: [(DIGEST_A, 6), (DIGEST_B, 0)],
        }
        for i, keys in derived.items():
            expected[i]["data"]["blocks"][0]["mm_keys"] = [
                {"type": "mm_key", "hash": d.hex(), "start_offset": s} for d, s in keys
            ]
        assert out == expected
        # without the offset, token ids are written as ints
        plain = to_trtllm_events(batches)
        assert plain[1]["data"]["blocks"][0]["tokens"][0]["token_id"] == self.OFFSET

    def test_reader_continues_items_across_reads(self) -> None:
        events = load("trtllm_v2_multimodal.json")["events"]
        reader = TrtllmEventReader(
            instance_id="trt-0", tokens_per_block=4, mm_token_id_offset=self.OFFSET
        )
        reader.read(events[:2])
        (batch,) = reader.read(events[2:])
        data = batch.events[0].data
        assert isinstance(data, Stored)
        assert [k.start_offset for k in data.blocks[0].mm_keys] == [3, 4]
        # a fresh reader has not seen item a
        with pytest.raises(
            InteropError,
            match=r"^event\[0\]\.data\.blocks\[0\]\.tokens\[0\]\.token_id: token id > "
            r"mm_token_id_offset 1000 continues a multimodal item",
        ):
            read(events[2:], mm_token_id_offset=self.OFFSET)
        # ... unless the block lists its mm_keys
        listed = copy.deepcopy(events[2])
        listed["data"]["blocks"][0]["mm_keys"] = [
            {"type": "mm_key", "hash": DIGEST_A.hex(), "start_offset": 3}
        ]
        assert read([listed], mm_token_id_offset=self.OFFSET)[0].events[0].event_id == 2

    def test_hex_token_needs_an_offset(self) -> None:
        events = load("trtllm_v2_multimodal.json")["events"]
        with pytest.raises(
            InteropError,
            match=r"^event\[1\]\.data\.blocks\[0\]\.tokens\[0\]\.token_id: a 64-char hex token "
            r"is a TensorRT-LLM V2 multimodal digest; pass mm_token_id_offset=",
        ):
            read(events, tokens_per_block=4)

    def test_offset_token_id_is_reserved(self) -> None:
        events = load("trtllm_v2_multimodal.json")["events"]
        bad = copy.deepcopy(events[2])
        bad["data"]["blocks"][0]["tokens"][1]["token_id"] = self.OFFSET
        with pytest.raises(InteropError, match=r"tokens\[1\]\.token_id: token id 1000 equals"):
            read([events[1], bad], mm_token_id_offset=self.OFFSET)

    def test_writing_a_digest_token_needs_its_key(self) -> None:
        block = StoredBlock(block_hash=b"\x01" * 32, token_ids=[5, self.OFFSET])
        ev = KVCacheEvent(
            event_id=0, hash_algo="v2_sha256", window_size=8, data=Stored(blocks=(block,))
        )
        batch = EventBatch(source=SourceId(instance_id="x"), ts_ns=0, events=(ev,))
        with pytest.raises(
            InteropError,
            match=r"^batches\[0\]\.events\[0\]\.data\.blocks\[0\]\.token_ids\[1\]: token id 1000",
        ):
            to_trtllm_events(batch, mm_token_id_offset=self.OFFSET)
        assert to_trtllm_events(batch)[0]["data"]["blocks"][0]["tokens"][1]["token_id"] == 1000

    def test_uuid_modes(self) -> None:
        key = MmKey(hash=DIGEST_A, start_offset=2, uuid="u-1")
        unknown = MmKey(hash=bytes(32), start_offset=0, uuid="u-2")
        block = StoredBlock(block_hash=b"\x02" * 8, token_ids=[1], mm_keys=(key, unknown))
        ev = KVCacheEvent(event_id=0, window_size=8, data=Stored(blocks=(block,)))
        additive = to_trtllm_event(ev)["data"]["blocks"][0]["mm_keys"]
        assert additive == [
            {"type": "mm_key", "hash": DIGEST_A.hex(), "uuid": "u-1", "start_offset": 2},
            {"type": "mm_key", "hash": "u-2", "start_offset": 0},  # digest unknown
        ]
        replaces = to_trtllm_event(ev, mm_uuid_mode="replaces_hash")["data"]["blocks"][0]
        assert replaces["mm_keys"] == [
            {"type": "mm_key", "hash": "u-1", "start_offset": 2},
            {"type": "mm_key", "hash": "u-2", "start_offset": 0},
        ]
        # reading the V1 form keeps the uuid; the digest is the unknown sentinel
        back = from_trtllm_event(to_trtllm_event(ev, mm_uuid_mode="replaces_hash")).event
        assert isinstance(back.data, Stored)
        assert back.data.blocks[0].mm_keys == (
            MmKey(hash=bytes(32), start_offset=2, uuid="u-1"),
            unknown,
        )
        with pytest.raises(ConfigError, match="mm_uuid_mode"):
            to_trtllm_event(ev, mm_uuid_mode="sideways")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Defaults, options and kvstream-only kinds
# --------------------------------------------------------------------------------------------


def minimal_stored(**envelope: Any) -> dict[str, Any]:
    return {
        "event_id": 0,
        "window_size": 16,
        "data": {
            "type": "stored",
            "blocks": [{"block_hash": 1, "tokens": [{"token_id": 3}, {"token_id": 4}]}],
        },
        **envelope,
    }


def test_defaults_when_reading() -> None:
    ev = from_trtllm_event(minimal_stored(layer_group_id=None, hash_algo=None)).event
    assert (ev.hash_algo, ev.layer_group_id) == ("v1_block_key", 0)
    assert ev.data == Stored(
        parent_hash=None,
        blocks=(
            StoredBlock(
                block_hash=v1(1),
                token_ids=[3, 4],
                token_extra_ids=None,
                cache_level=0,
                priority=35,
                mm_keys=(),
                cache_salt=None,
            ),
        ),
    )
    # TensorRT-LLM's router falls back to data.hash_algo; so do we
    alt = minimal_stored()
    alt["data"]["hash_algo"] = "v2_sha256_64"
    assert from_trtllm_event(alt).event.hash_algo == "v2_sha256_64"
    # missing window_size -> default_window_size
    no_window = minimal_stored()
    del no_window["window_size"]
    assert from_trtllm_event(no_window, default_window_size=99).event.window_size == 99
    # unknown keys are ignored
    extra = minimal_stored(future_field={"x": 1})
    extra["data"]["blocks"][0]["future"] = [1]
    assert from_trtllm_event(extra).event == from_trtllm_event(minimal_stored()).event


def test_hash_widths_and_big_values() -> None:
    big = 2**64 - 1
    for value, expected in [(big, big), (-1, big), (2**63, 2**63), (-(2**63), 2**63), (0, 0)]:
        raw = minimal_stored()
        raw["data"]["blocks"][0]["block_hash"] = value
        got = from_trtllm_event(raw).event
        assert isinstance(got.data, Stored)
        assert got.data.blocks[0].block_hash == expected.to_bytes(8, "big")
        assert to_trtllm_event(got)["data"]["blocks"][0]["block_hash"] == expected
    # a 16-char hex string is a 64-bit hash too
    raw = minimal_stored()
    raw["data"]["blocks"][0]["block_hash"] = "FFFFFFFFFFFFFFFF"
    got = from_trtllm_event(raw).event
    assert isinstance(got.data, Stored)
    assert got.data.blocks[0].block_hash == b"\xff" * 8
    # unknown algorithms: ints are 8 bytes, hex is len/2 bytes, written back the same way
    unknown: list[tuple[str, int | str]] = [
        ("future_64", 12345),
        ("future_128", "ab" * 16),
        ("future_256", "cd" * 32),
    ]
    for algo, hash_value in unknown:
        raw = minimal_stored(hash_algo=algo)
        raw["data"]["blocks"][0]["block_hash"] = hash_value
        got = from_trtllm_event(raw).event
        assert to_trtllm_event(got)["data"]["blocks"][0]["block_hash"] == hash_value


def test_tokens_extras_lora_and_negative_ids() -> None:
    raw = minimal_stored()
    block = raw["data"]["blocks"][0]
    block["tokens"] = [
        {"type": "unique_token", "token_id": -1, "token_extra_id": 0},
        {"type": "unique_token", "token_id": TOKEN_ID_MAX, "token_extra_id": 9},
    ]
    block["lora_id"] = 2**64 - 1
    block["lora_name"] = "adapter"
    ev = from_trtllm_event(raw).event
    assert isinstance(ev.data, Stored)
    b = ev.data.blocks[0]
    assert b.token_ids == [TOKEN_ID_MAX, TOKEN_ID_MAX]  # -1 wraps like v1_block_key hashes it
    assert b.token_extra_ids == [0, 9]
    assert (b.lora_id, b.lora_name) == (2**64 - 1, "adapter")
    out = to_trtllm_event(ev)["data"]["blocks"][0]
    assert out["tokens"][0]["token_id"] == TOKEN_ID_MAX
    assert (out["lora_id"], out["lora_name"]) == (2**64 - 1, "adapter")
    assert (
        "lora_id"
        not in to_trtllm_event(from_trtllm_event(minimal_stored()).event)["data"]["blocks"][0]
    )


def test_updated_null_diffs() -> None:
    raw: dict[str, Any] = {
        "event_id": 1,
        "window_size": 16,
        "data": {
            "type": "updated",
            "block_hash": 5,
            "cache_level": None,
            "priority": {"type": "event_diff", "new_value": 80, "old_value": 35},
        },
    }
    ev = from_trtllm_event(raw).event
    assert ev.data == Updated(
        block_hash=v1(5), cache_level=None, priority=EventDiff(old_value=35, new_value=80)
    )
    assert to_trtllm_event(ev)["data"] == raw["data"]
    missing = copy.deepcopy(raw)
    del missing["data"]["cache_level"]
    assert from_trtllm_event(missing).event == ev


def test_created_tokens_per_block() -> None:
    raw = {
        "event_id": 0,
        "window_size": 16,
        "data": {"type": "created", "num_blocks_per_cache_level": [8]},
    }
    with pytest.raises(
        InteropError, match=r"^event\.data: TensorRT-LLM's created events carry no tokens_per_block"
    ):
        from_trtllm_event(raw)
    ev = from_trtllm_event(raw, tokens_per_block=32).event
    assert ev.data == Created(num_blocks_per_cache_level=(8,), tokens_per_block=32)
    # the kvstream extension key wins over the argument
    ext = to_trtllm_event(
        KVCacheEvent(
            event_id=0,
            window_size=16,
            data=Created(
                num_blocks_per_cache_level=(8, 2, 1),
                tokens_per_block=64,
                attention_kind=AttentionKind.SLIDING_WINDOW,
            ),
        ),
        extensions=True,
    )
    assert ext["data"] == {
        "type": "created",
        "num_blocks_per_cache_level": [8, 2, 1],
        "tokens_per_block": 64,
        "attention_kind": "sliding_window",
    }
    back = from_trtllm_event(ext, tokens_per_block=32).event.data
    assert isinstance(back, Created)
    assert (back.tokens_per_block, back.attention_kind) == (64, AttentionKind.SLIDING_WINDOW)


def test_kvstream_kinds_and_options() -> None:
    events = (
        KVCacheEvent(event_id=0, window_size=8, data=Removed(block_hashes=(v1(1),), cache_level=2)),
        KVCacheEvent(event_id=1, window_size=8, data=Cleared()),
        KVCacheEvent(
            event_id=2, window_size=8, data=Lost(first_event_id=7, count=3, reason="overflow")
        ),
        KVCacheEvent(event_id=3, hash_algo="v2_sha256", window_size=8, data=Cleared()),
    )
    batch = EventBatch(
        source=SourceId(instance_id="x", attention_dp_rank=2), ts_ns=1, events=events
    )
    out = to_trtllm_events(batch)
    assert [e["data"] for e in out] == [
        {"type": "removed", "block_hashes": [1]},
        {"type": "cleared"},
        {"type": "lost", "first_event_id": 7, "count": 3, "reason": "overflow"},
        {"type": "cleared"},
    ]
    assert all(e["attention_dp_rank"] == 2 for e in out)
    assert [e["event_id"] for e in to_trtllm_events(batch, include_kvstream_kinds=False)] == [0]
    assert to_trtllm_events(batch, extensions=True)[0]["data"]["cache_level"] == 2
    back = read(out, instance_id="x", ts_ns=1)
    assert back[0].events[1:] == events[1:]
    with pytest.raises(
        InteropError,
        match=r"^batches\[0\]\.events\[3\]\.hash_algo: include_hash_algo=False writes "
        r"TensorRT-LLM V1's shape",
    ):
        to_trtllm_events([batch], include_hash_algo=False)
    with pytest.raises(TypeError, match=r"batches\[1\]: expected an EventBatch"):
        to_trtllm_events([batch, {"event_id": 0}])  # type: ignore[list-item]


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        from_trtllm_events([], instance_id="")
    with pytest.raises(ConfigError, match="tokens_per_block"):
        from_trtllm_events([], instance_id="x", tokens_per_block=0)
    with pytest.raises(ConfigError, match="mm_token_id_offset"):
        from_trtllm_events([], instance_id="x", mm_token_id_offset=-1)
    with pytest.raises(ConfigError, match="ts_ns"):
        from_trtllm_events([], instance_id="x", ts_ns=-5)
    with pytest.raises(ConfigError, match="incarnation"):
        TrtllmEventReader(instance_id="x", incarnation=-1)


# --------------------------------------------------------------------------------------------
# Malformed input: InteropError naming the location
# --------------------------------------------------------------------------------------------

V2_HASH = "e432228522a304ab556d66e6e40979ad05575f28b19b554264dd3c6277aaf073"


def v2_stored(block_hash: Any = V2_HASH, **block: Any) -> dict[str, Any]:
    good = {"type": "stored_block", "block_hash": V2_HASH, "tokens": [{"token_id": 1}]}
    return {
        "event_id": 1,
        "window_size": 16,
        "hash_algo": "v2_sha256",
        "data": {
            "type": "stored",
            "parent_hash": None,
            "blocks": [good, {**good, "block_hash": block_hash, **block}],
        },
    }


def with_data(**data: Any) -> dict[str, Any]:
    return {"event_id": 0, "window_size": 16, "data": data}


MALFORMED: list[tuple[str, Any, str]] = [
    ("not a list", {"event_id": 0}, r"^events: expected a list of event objects, got object"),
    ("event not an object", [42], r"^event\[0\]: expected an object, got int 42"),
    ("missing data", [{"event_id": 0, "window_size": 4}], r"^event\[0\]\.data: missing required"),
    ("missing type", [with_data(blocks=[])], r"^event\[0\]\.data\.type: missing required field"),
    ("unknown type", [with_data(type="evicted")], r"^event\[0\]\.data\.type: unknown event type"),
    (
        "short hex hash",
        [
            with_data(type="cleared"),
            with_data(type="cleared"),
            with_data(type="cleared"),
            v2_stored("abcd"),
        ],
        r"^event\[3\]\.data\.blocks\[1\]\.block_hash: expected hex string of 64 chars",
    ),
    (
        "int hash for v2_sha256",
        [v2_stored(12345)],
        r"^event\[0\]\.data\.blocks\[1\]\.block_hash: expected hex string of 64 chars "
        r"\(v2_sha256 hashes are 32 bytes\), got int 12345",
    ),
    (
        "non-hex hash",
        [v2_stored("zz" * 32)],
        r"^event\[0\]\.data\.blocks\[1\]\.block_hash: expected hex string of 64 chars",
    ),
    (
        "hash wider than 64 bits",
        [with_data(type="removed", block_hashes=[1, 2**64])],
        r"^event\[0\]\.data\.block_hashes\[1\]: integer hash 18446744073709551616 does not fit",
    ),
    (
        "hash of the wrong type",
        [with_data(type="removed", block_hashes=[1.5])],
        r"^event\[0\]\.data\.block_hashes\[0\]: expected an integer \(v1_block_key hash\), "
        r"got float 1\.5",
    ),
    (
        "bool token id",
        [v2_stored(tokens=[{"token_id": 1}, {"token_id": True}])],
        r"^event\[0\]\.data\.blocks\[1\]\.tokens\[1\]\.token_id: expected an integer, got bool",
    ),
    (
        "token id too large",
        [v2_stored(tokens=[{"token_id": 2**32}])],
        r"^event\[0\]\.data\.blocks\[1\]\.tokens\[0\]\.token_id: 4294967296 is outside",
    ),
    (
        "short hex token",
        [v2_stored(tokens=[{"token_id": "abcd"}])],
        r"^event\[0\]\.data\.blocks\[1\]\.tokens\[0\]\.token_id: expected an integer or a 64-char",
    ),
    (
        "wrong token tag",
        [v2_stored(tokens=[{"type": "token", "token_id": 1}])],
        r"^event\[0\]\.data\.blocks\[1\]\.tokens\[0\]\.type: expected 'unique_token'",
    ),
    (
        "tokens not a list",
        [v2_stored(tokens={"token_id": 1})],
        r"^event\[0\]\.data\.blocks\[1\]\.tokens: expected a list, got object",
    ),
    (
        "priority out of range",
        [v2_stored(priority=101)],
        r"^event\[0\]\.data\.blocks\[1\]\.priority: 101 is outside 0\.\.100",
    ),
    (
        "cache_salt not a string",
        [v2_stored(cache_salt=7)],
        r"^event\[0\]\.data\.blocks\[1\]\.cache_salt: expected a string, got int 7",
    ),
    (
        "mm_key start_offset negative",
        [v2_stored(mm_keys=[{"type": "mm_key", "hash": "00" * 32, "start_offset": -1}])],
        r"^event\[0\]\.data\.blocks\[1\]\.mm_keys\[0\]\.start_offset: -1 is outside",
    ),
    (
        "64-bit extra id on a text token",
        [v2_stored(tokens=[{"token_id": 5, "token_extra_id": 2**63}])],
        r"^event\[0\]\.data\.blocks\[1\]\.tokens\[0\]\.token_extra_id: 9223372036854775808",
    ),
    (
        "mm_key uuid contradicts",
        [v2_stored(mm_keys=[{"hash": "u-1", "uuid": "u-2", "start_offset": 0}])],
        r"^event\[0\]\.data\.blocks\[1\]\.mm_keys\[0\]\.uuid: 'u-2' contradicts",
    ),
    (
        "empty blocks",
        [with_data(type="stored", parent_hash=None, blocks=[])],
        r"^event\[0\]\.data\.blocks: expected at least one stored_block",
    ),
    (
        "negative rank",
        [{**with_data(type="cleared"), "attention_dp_rank": -1}],
        r"^event\[0\]\.attention_dp_rank: -1 is outside",
    ),
    (
        "hash_algo not a string",
        [{**with_data(type="cleared"), "hash_algo": 3}],
        r"^event\[0\]\.hash_algo: expected a string, got int 3",
    ),
    (
        "bad event_diff tag",
        [with_data(type="updated", block_hash=1, cache_level={"type": "diff", "new_value": 1})],
        r"^event\[0\]\.data\.cache_level\.type: expected 'event_diff'",
    ),
    (
        "event_diff missing old_value",
        [with_data(type="updated", block_hash=1, priority={"new_value": 1})],
        r"^event\[0\]\.data\.priority\.old_value: missing required field",
    ),
    (
        "updated changes nothing (model rule)",
        [with_data(type="updated", block_hash=1, cache_level=None, priority=None)],
        r"^event\[0\]\.data: invalid Updated: .*must change cache_level or priority",
    ),
    (
        "empty removal (model rule)",
        [with_data(type="removed", block_hashes=[])],
        r"^event\[0\]\.data: invalid Removed",
    ),
    (
        "mixed widths under an unknown algorithm (model rule)",
        [{**with_data(type="removed", block_hashes=[1, "ab" * 32]), "hash_algo": "future"}],
        r"^event\[0\]: invalid KVCacheEvent: .*data\.block_hashes\.1",
    ),
    (
        "lost count zero",
        [with_data(type="lost", first_event_id=0, count=0)],
        r"^event\[0\]\.data\.count: 0 is outside 1\.\.",
    ),
    (
        "extra id beyond uint32",
        [v2_stored(tokens=[{"token_id": 1, "token_extra_id": 2**40}])],
        r"^event\[0\]\.data\.blocks\[1\]\.tokens\[0\]\.token_extra_id: 1099511627776 is outside",
    ),
]


@pytest.mark.parametrize(
    ("events", "pattern"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_input_names_the_location(events: Any, pattern: str) -> None:
    with pytest.raises(InteropError) as info:
        read(events, tokens_per_block=4)
    assert re.search(pattern, str(info.value), re.DOTALL), str(info.value)


def test_model_errors_are_chained() -> None:
    with pytest.raises(InteropError) as info:
        read([with_data(type="removed", block_hashes=[])])
    assert type(info.value.__cause__).__name__ == "EventValidationError"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=70),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_input_raises_only_interop_errors(data: st.DataObject) -> None:
    """Replacing or deleting any field of valid events never escapes as KeyError/TypeError."""
    events = copy.deepcopy(
        data.draw(
            st.sampled_from(
                [
                    load("trtllm_reference_examples.json")["events"],
                    load("trtllm_v2_multimodal.json")["events"],
                    load("trtllm_v1_cpp_features.json")["events"],
                    load("trtllm_fanout_all_cleared.json")["events"],
                ]
            )
        )
    )
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths(events)[1:]))
        parent = events
        for p in path[:-1]:
            parent = parent[p]
        if isinstance(parent, dict) and data.draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(JSON)
    with contextlib.suppress(InteropError):
        read(events, tokens_per_block=4, mm_token_id_offset=1000)


# --------------------------------------------------------------------------------------------
# Round trips (hypothesis)
# --------------------------------------------------------------------------------------------

ALGO_WIDTHS = {
    "v1_block_key": 8,
    "v2_sha256": 32,
    "v2_sha256_64": 8,
    "blake3": 32,
    "future_algo_64": 8,
    "future_algo_128": 16,
}
TPB = 16
U32 = st.integers(0, TOKEN_ID_MAX)
I31 = st.integers(0, 2**31 - 1)
I63 = st.integers(0, 2**63 - 1)
TEXT = st.text(max_size=12)
# A real digest is never all zero; kvstream uses that value for "only the uuid is known".
DIGEST = st.binary(min_size=32, max_size=32).filter(any)
# A uuid in place of the hash that is all hex reads as a (short) digest: real uuids are not.
UUID = st.text(min_size=1, max_size=12).filter(lambda s: not re.fullmatch(r"[0-9a-fA-F]+", s))


def mm_keys_st() -> st.SearchStrategy[MmKey]:
    return st.builds(
        MmKey,
        hash=st.binary(min_size=32, max_size=32),
        start_offset=I31,
        uuid=st.none() | UUID,
    )


@st.composite
def stored_block_st(draw: st.DrawFn, width: int) -> StoredBlock:
    tokens = draw(st.lists(U32, max_size=6))
    extras = draw(st.none() | st.lists(U32, min_size=len(tokens), max_size=len(tokens)).filter(any))
    return StoredBlock(
        block_hash=draw(st.binary(min_size=width, max_size=width)),
        token_ids=tokens,
        token_extra_ids=extras,
        lora_id=draw(st.none() | st.integers(0, 2**64 - 1)),
        lora_name=draw(st.none() | TEXT),
        cache_level=draw(I31),
        priority=draw(st.integers(0, 100)),
        mm_keys=tuple(draw(st.lists(mm_keys_st(), max_size=2))),
        cache_salt=draw(st.none() | TEXT),
    )


@st.composite
def event_st(draw: st.DrawFn, extensions: bool) -> KVCacheEvent:
    algo = draw(st.sampled_from(sorted(ALGO_WIDTHS)))
    width = ALGO_WIDTHS[algo]
    hashes = st.binary(min_size=width, max_size=width)
    diff = st.builds(EventDiff, old_value=st.integers(0, 100), new_value=st.integers(0, 100))
    kind = draw(st.sampled_from(["created", "stored", "removed", "updated", "cleared", "lost"]))
    data: Any
    if kind == "created":
        data = Created(
            num_blocks_per_cache_level=tuple(draw(st.lists(I63, min_size=1, max_size=3))),
            tokens_per_block=draw(st.integers(1, 4096)) if extensions else TPB,
            attention_kind=draw(st.sampled_from(AttentionKind)) if extensions else "full_attention",
        )
    elif kind == "stored":
        data = Stored(
            parent_hash=draw(st.none() | hashes),
            blocks=tuple(draw(st.lists(stored_block_st(width), min_size=1, max_size=3))),
        )
    elif kind == "removed":
        data = Removed(
            block_hashes=tuple(draw(st.lists(hashes, min_size=1, max_size=4))),
            cache_level=draw(st.none() | I31) if extensions else None,
        )
    elif kind == "updated":
        level, prio = draw(
            st.tuples(st.none() | diff, st.none() | diff).filter(lambda t: t != (None, None))
        )
        data = Updated(block_hash=draw(hashes), cache_level=level, priority=prio)
    elif kind == "cleared":
        data = Cleared()
    else:
        data = Lost(
            first_event_id=draw(I63), count=draw(st.integers(1, 2**63 - 1)), reason=draw(TEXT)
        )
    return KVCacheEvent(
        event_id=draw(I63),
        hash_algo=algo,
        layer_group_id=draw(I31),
        window_size=draw(st.integers(1, 2**63 - 1)),
        data=data,
    )


@st.composite
def batch_st(draw: st.DrawFn, extensions: bool = False) -> EventBatch:
    return EventBatch(
        source=SourceId(
            instance_id=draw(st.text(min_size=1, max_size=10)),
            attention_dp_rank=draw(st.none() | I31),
            incarnation=draw(I63),
        ),
        ts_ns=draw(I63),
        events=tuple(draw(st.lists(event_st(extensions), min_size=1, max_size=5))),
    )


def read_back(batch: EventBatch, out: list[dict[str, Any]], **kw: Any) -> list[EventBatch]:
    return from_trtllm_events(
        json.loads(json.dumps(out)),  # through real JSON text
        instance_id=batch.source.instance_id,
        incarnation=batch.source.incarnation,
        ts_ns=batch.ts_ns,
        **kw,
    )


@settings(deadline=None)
@given(batch=batch_st())
def test_model_json_model_round_trip(batch: EventBatch) -> None:
    assert read_back(batch, to_trtllm_events(batch), tokens_per_block=TPB) == [batch]


@settings(deadline=None)
@given(batch=batch_st(extensions=True))
def test_model_json_model_round_trip_with_extensions(batch: EventBatch) -> None:
    out = to_trtllm_events(batch, extensions=True)
    assert read_back(batch, out) == [batch]


# -- TensorRT-LLM JSON -> model -> JSON --------------------------------------------------------


def raw_hash_st(width: int) -> st.SearchStrategy[tuple[Any, Any]]:
    """(as a producer may write it, as kvstream writes it back)."""
    if width == 8:
        return st.integers(0, 2**64 - 1).flatmap(
            lambda v: st.sampled_from([(v, v), (v - 2**64 if v >= 2**63 else v, v)])
        )
    return st.binary(min_size=width, max_size=width).flatmap(
        lambda b: st.sampled_from([(b.hex(), b.hex()), (b.hex().upper(), b.hex())])
    )


def maybe(d: dict[str, Any], key: str, value: Any, default: Any, omit: bool) -> None:
    """Put ``key`` in ``d``, or leave it out when it equals its default and ``omit``."""
    if not (omit and value == default):
        d[key] = value


@st.composite
def trt_event_st(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    """A TensorRT-LLM event as a producer may write it, and its normalised form."""
    algo = draw(st.sampled_from([*sorted(ALGO_WIDTHS), None]))
    width = ALGO_WIDTHS.get(algo or "v1_block_key", 8)
    omit = draw(st.booleans())
    kind = draw(st.sampled_from(["created", "stored", "removed", "updated", "cleared", "lost"]))
    raw_data: dict[str, Any] = {"type": kind}
    norm_data: dict[str, Any] = {"type": kind}
    if kind == "created":
        levels = draw(st.lists(I63, min_size=1, max_size=3))
        raw_data["num_blocks_per_cache_level"] = norm_data["num_blocks_per_cache_level"] = levels
    elif kind == "stored":
        parent = draw(st.none() | raw_hash_st(width))
        if parent is not None or not omit:
            raw_data["parent_hash"] = None if parent is None else parent[0]
        norm_data["parent_hash"] = None if parent is None else parent[1]
        raw_blocks, norm_blocks = [], []
        for _ in range(draw(st.integers(1, 3))):
            h = draw(raw_hash_st(width))
            raw_b: dict[str, Any] = {"block_hash": h[0]}
            norm_b: dict[str, Any] = {"type": "stored_block", "block_hash": h[1]}
            if not omit:
                raw_b["type"] = "stored_block"
            raw_toks, norm_toks = [], []
            for tid in draw(st.lists(st.integers(-(2**31), TOKEN_ID_MAX), max_size=5)):
                extra = draw(st.sampled_from([0, 0, 5, TOKEN_ID_MAX]))
                t: dict[str, Any] = {"token_id": tid}
                if not omit:
                    t["type"] = "unique_token"
                maybe(t, "token_extra_id", extra, 0, omit)
                raw_toks.append(t)
                norm_toks.append(
                    {"type": "unique_token", "token_id": tid % 2**32, "token_extra_id": extra}
                )
            raw_b["tokens"], norm_b["tokens"] = raw_toks, norm_toks
            level = draw(st.sampled_from([0, 1, 2]))
            prio = draw(st.sampled_from([35, 0, 100, 50]))
            maybe(raw_b, "cache_level", level, 0, omit)
            maybe(raw_b, "priority", prio, 35, omit)
            norm_b["cache_level"], norm_b["priority"] = level, prio
            keys = []
            for _ in range(draw(st.integers(0, 2))):
                key: dict[str, Any] = {"type": "mm_key"}
                uuid = draw(st.none() | UUID)
                if uuid is not None and draw(st.booleans()):  # V1: uuid replaces the hash
                    key["hash"] = uuid
                else:
                    key["hash"] = draw(DIGEST).hex()
                    if uuid is not None:
                        key["uuid"] = uuid
                key["start_offset"] = draw(I31)
                keys.append(key)
            maybe(raw_b, "mm_keys", keys, [], omit)
            norm_b["mm_keys"] = keys
            salt = draw(st.none() | TEXT)
            maybe(raw_b, "cache_salt", salt, None, omit)
            norm_b["cache_salt"] = salt
            if draw(st.booleans()):
                raw_b["lora_id"] = norm_b["lora_id"] = draw(st.integers(0, 2**64 - 1))
            raw_blocks.append(raw_b)
            norm_blocks.append(norm_b)
        raw_data["blocks"], norm_data["blocks"] = raw_blocks, norm_blocks
    elif kind == "removed":
        hs = draw(st.lists(raw_hash_st(width), min_size=1, max_size=4))
        raw_data["block_hashes"] = [h[0] for h in hs]
        norm_data["block_hashes"] = [h[1] for h in hs]
    elif kind == "updated":
        h = draw(raw_hash_st(width))
        raw_data["block_hash"], norm_data["block_hash"] = h
        diff = st.builds(
            lambda n, o: {"type": "event_diff", "new_value": n, "old_value": o},
            st.integers(0, 100),
            st.integers(0, 100),
        )
        level, prio = draw(
            st.tuples(st.none() | diff, st.none() | diff).filter(lambda t: t != (None, None))
        )
        maybe(raw_data, "cache_level", level, None, omit)
        maybe(raw_data, "priority", prio, None, omit)
        norm_data["cache_level"], norm_data["priority"] = level, prio
    elif kind == "lost":
        raw_data["first_event_id"] = norm_data["first_event_id"] = draw(I63)
        raw_data["count"] = norm_data["count"] = draw(st.integers(1, 2**63 - 1))
        reason = draw(st.sampled_from(["overflow", "queue full"]))
        maybe(raw_data, "reason", reason, "overflow", omit)
        norm_data["reason"] = reason

    event_id, window = draw(I63), draw(st.integers(1, 2**63 - 1))
    rank = draw(st.none() | st.integers(0, 3))
    lg = draw(st.sampled_from([0, 0, 1, 7]))
    raw: dict[str, Any] = {"event_id": event_id, "data": raw_data, "window_size": window}
    norm: dict[str, Any] = {"event_id": event_id, "data": norm_data, "window_size": window}
    if rank is not None:
        raw["attention_dp_rank"] = norm["attention_dp_rank"] = rank
    if algo is not None or not omit:
        raw["hash_algo"] = algo
    norm["hash_algo"] = algo or "v1_block_key"
    if lg != 0 or not omit:
        raw["layer_group_id"] = lg if lg != 0 or draw(st.booleans()) else None
    norm["layer_group_id"] = lg
    if draw(st.booleans()):
        raw["some_future_field"] = [1, 2]
    return raw, norm


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs=st.lists(trt_event_st(), max_size=6))
def test_json_model_json_round_trip(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    raw = [r for r, _ in pairs]
    # kvstream writes one batch per rank, ranks in first-seen order
    ranks = list(dict.fromkeys(n.get("attention_dp_rank") for _, n in pairs))
    expected = [n for rank in ranks for _, n in pairs if n.get("attention_dp_rank") == rank]
    batches = read(json.loads(json.dumps(raw)), tokens_per_block=TPB)
    assert to_trtllm_events(batches) == expected


# -- V2 multimodal chains --------------------------------------------------------------------

MM_OFFSET = 50_000


@st.composite
def mm_chain_st(draw: st.DrawFn) -> tuple[list[list[int | bytes]], list[list[tuple[bytes, int]]]]:
    """Engine token blocks (ints and raw digests) of one V2 chain, and each block's mm_keys
    computed from how the stream was built (not from the decoding rule)."""
    digests = draw(st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=3))
    stream: list[tuple[int | bytes, bytes | None, int]] = []  # (token, item, local index)
    current: bytes | None = None
    next_local: dict[bytes, int] = {}
    for _ in range(draw(st.integers(1, 6))):
        choice = draw(st.sampled_from(["text", "item", "more"]))
        n = draw(st.integers(1, 4))
        if choice == "text":
            stream += [(draw(st.integers(0, MM_OFFSET - 1)), None, 0) for _ in range(n)]
        elif choice == "item" or current is None:
            current = draw(st.sampled_from(digests))  # the same item may come again
            stream.append((current, current, 0))
            next_local[current] = 1
            choice = "more"
            n -= 1
        if choice == "more":
            assert current is not None
            for _ in range(n):
                local = next_local[current]
                stream.append((MM_OFFSET + local, current, local))
                next_local[current] = local + 1
    assume(stream)
    tpb = 4
    blocks, keys = [], []
    for start in range(0, len(stream), tpb):
        chunk = stream[start : start + tpb]
        blocks.append([t for t, _, _ in chunk])
        block_keys = []
        for k, (_, item, local) in enumerate(chunk):
            if item is not None and (local == 0 or k == 0 or chunk[k - 1][1] != item):
                block_keys.append((item, local))
        keys.append(block_keys)
    return blocks, keys


def mm_events(
    blocks: list[list[int | bytes]], keys: list[list[tuple[bytes, int]]] | None, split: int
) -> list[dict[str, Any]]:
    hashes = v2_keys(None, blocks)
    json_blocks = [
        {
            "type": "stored_block",
            "block_hash": h.hex(),
            "tokens": [
                {
                    "type": "unique_token",
                    "token_id": t.hex() if isinstance(t, bytes) else t,
                    "token_extra_id": 0,
                }
                for t in b
            ],
            "cache_level": 0,
            "priority": 35,
            "mm_keys": []
            if keys is None
            else [{"type": "mm_key", "hash": d.hex(), "start_offset": s} for d, s in keys[i]],
            "cache_salt": None,
        }
        for i, (h, b) in enumerate(zip(hashes, blocks, strict=True))
    ]
    groups = (
        [json_blocks[:split], json_blocks[split:]]
        if 0 < split < len(json_blocks)
        else [json_blocks]
    )
    out = []
    for i, group in enumerate(groups):
        parent = None if i == 0 else json_blocks[split - 1]["block_hash"]
        out.append(
            {
                "event_id": i,
                "data": {"type": "stored", "parent_hash": parent, "blocks": group},
                "window_size": 4096,
                "hash_algo": "v2_sha256",
                "layer_group_id": 0,
            }
        )
    return out


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=mm_chain_st(), split=st.integers(0, 4))
def test_multimodal_chains(
    chain: tuple[list[list[int | bytes]], list[list[tuple[bytes, int]]]], split: int
) -> None:
    blocks, keys = chain
    published = mm_events(blocks, keys, split)
    # published mm_keys: a faithful round trip, and block hashes are re-derivable
    batches = read(published, mm_token_id_offset=MM_OFFSET)
    assert to_trtllm_events(batches, mm_token_id_offset=MM_OFFSET) == published
    stored = [b for e in batches[0].events if isinstance(e.data, Stored) for b in e.data.blocks]
    assert v2_keys(None, [engine_tokens(b, MM_OFFSET) for b in stored]) == [
        b.block_hash for b in stored
    ]
    # empty mm_keys (older V2): derived by the section 3.3 rule, equal to the construction
    derived = read(mm_events(blocks, None, split), mm_token_id_offset=MM_OFFSET)
    assert derived == batches

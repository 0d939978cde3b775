"""Every TensorRT-LLM KV-event shape in tests/data/trtllm/shapes reads as its manifest says.

The manifest's ``expected`` batches were written by hand from each producer's source; this
module only compares what :mod:`kvstream.engines.trtllm` reads with them, then checks the
rules the shapes exercise (event numbering across reads, tolerant reads, short mm hashes,
64-bit extra ids, ``data``-level LoRA and salt) on their own.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kvstream.engines.trtllm import TrtllmEventReader, from_trtllm_events, to_trtllm_events
from kvstream.errors import ConfigError, InteropError
from kvstream.events.model import (
    UNBOUNDED_WINDOW,
    Cleared,
    Created,
    EventBatch,
    KVCacheEvent,
    Lost,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)

SHAPES = Path(__file__).parent / "data" / "trtllm" / "shapes"
MANIFEST: list[dict[str, Any]] = json.loads((SHAPES / "manifest.json").read_text())["shapes"]
TS = 1_700_000_000_000_000_000
BLOCK_DEFAULTS: dict[str, Any] = {
    "extra": None,
    "lora_id": None,
    "lora_name": None,
    "salt": None,
    "level": 0,
    "priority": 35,
    "mm": [],
}


def compact_hash(value: bytes) -> int | str:
    return int.from_bytes(value, "big") if len(value) == 8 else value.hex()


def compact_block(block: StoredBlock) -> dict[str, Any]:
    return {
        "hash": compact_hash(block.block_hash),
        "tokens": block.token_ids.tolist(),
        "extra": None if block.token_extra_ids is None else block.token_extra_ids.tolist(),
        "lora_id": block.lora_id,
        "lora_name": block.lora_name,
        "salt": block.cache_salt,
        "level": block.cache_level,
        "priority": block.priority,
        "mm": [[k.hash.hex(), k.start_offset, k.uuid] for k in block.mm_keys],
    }


def compact_event(event: KVCacheEvent) -> dict[str, Any]:
    """The manifest's notation (tests/data/trtllm/shapes/README.md) of one event."""
    out: dict[str, Any] = {
        "id": event.event_id,
        "kind": event.kind.value,
        "window": event.window_size,
        "algo": event.hash_algo,
        "lg": event.layer_group_id,
    }
    data = event.data
    if isinstance(data, Created):
        out.update(levels=list(data.num_blocks_per_cache_level), tpb=data.tokens_per_block)
    elif isinstance(data, Stored):
        parent = None if data.parent_hash is None else compact_hash(data.parent_hash)
        out.update(parent=parent, blocks=[compact_block(b) for b in data.blocks])
    elif isinstance(data, Removed):
        out["hashes"] = [compact_hash(h) for h in data.block_hashes]
    elif isinstance(data, Updated):
        out["hash"] = compact_hash(data.block_hash)
        for key, diff in (("level", data.cache_level), ("priority", data.priority)):
            out[key] = None if diff is None else [diff.old_value, diff.new_value]
    else:
        assert isinstance(data, (Cleared, Lost))
    return out


def with_defaults(expected_event: dict[str, Any]) -> dict[str, Any]:
    out = dict(expected_event)
    if "blocks" in out:
        out["blocks"] = [{**BLOCK_DEFAULTS, **b} for b in out["blocks"]]
    return out


def compact(batches: list[EventBatch]) -> list[dict[str, Any]]:
    return [
        {
            "rank": b.source.attention_dp_rank,
            "events": [compact_event(e) for e in b.events],
        }
        for b in batches
    ]


def load(name: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = json.loads((SHAPES / name).read_text())
    return events


def test_the_corpus_is_complete() -> None:
    files = {p.name for p in SHAPES.glob("*.json")} - {"manifest.json"}
    assert {s["file"] for s in MANIFEST} == files
    assert len(MANIFEST) >= 25
    for shape in MANIFEST:
        assert shape["sources"], shape["file"]
        assert all(
            s.get("commit") or s.get("search_index_id") or s.get("why") for s in shape["sources"]
        )


@pytest.mark.parametrize("shape", MANIFEST, ids=[s["file"].removesuffix(".json") for s in MANIFEST])
def test_shape_reads_as_expected(shape: dict[str, Any]) -> None:
    events = load(shape["file"])
    batches = from_trtllm_events(
        copy.deepcopy(events), instance_id="trt-shapes", ts_ns=TS, **shape.get("options", {})
    )
    expected = [
        {"rank": b["rank"], "events": [with_defaults(e) for e in b["events"]]}
        for b in shape["expected"]
    ]
    assert compact(batches) == expected
    assert events == load(shape["file"])  # the input is not mutated
    # what was read writes back and reads again to the same batches (ids and windows now set)
    again = from_trtllm_events(
        to_trtllm_events(
            batches, mm_token_id_offset=shape.get("options", {}).get("mm_token_id_offset")
        ),
        instance_id="trt-shapes",
        ts_ns=TS,
        **shape.get("options", {}),
    )
    assert compact(again) == compact(batches)


@pytest.mark.parametrize("shape", MANIFEST, ids=[s["file"].removesuffix(".json") for s in MANIFEST])
def test_shape_reads_the_same_tolerantly(shape: dict[str, Any]) -> None:
    reader = TrtllmEventReader(instance_id="trt-shapes", **shape.get("options", {}))
    result = reader.read_tolerant(load(shape["file"]), ts_ns=TS)
    assert result.errors == []
    plain = from_trtllm_events(
        load(shape["file"]), instance_id="trt-shapes", ts_ns=TS, **shape.get("options", {})
    )
    assert result.batches == plain


# --------------------------------------------------------------------------------------------
# Event numbering
# --------------------------------------------------------------------------------------------


def stored(block_hash: int, **envelope: Any) -> dict[str, Any]:
    return {
        "data": {
            "type": "stored",
            "parent_hash": None,
            "blocks": [{"block_hash": block_hash, "tokens": [{"token_id": 1}]}],
        },
        **envelope,
    }


MARKER = {"data": {"type": "all_cleared"}}


def ids(batches: list[EventBatch]) -> list[tuple[int | None, list[int]]]:
    return [(b.source.attention_dp_rank, [e.event_id for e in b.events]) for b in batches]


def test_events_without_ids_are_numbered_per_rank_across_reads() -> None:
    reader = TrtllmEventReader(instance_id="oe")
    first = reader.read([stored(1), stored(2, attention_dp_rank=1), stored(3)], ts_ns=TS)
    assert ids(first) == [(None, [0, 1]), (1, [0])]
    second = reader.read([stored(4, attention_dp_rank=1), stored(5), stored(6)], ts_ns=TS)
    assert ids(second) == [(1, [1]), (None, [2, 3])]
    # an explicit id resets nothing: later id-less events continue after it
    third = reader.read([stored(7, event_id=10), stored(8)], ts_ns=TS)
    assert ids(third) == [(None, [10, 11])]


def test_a_run_without_ids_takes_the_ids_just_before_the_next_numbered_event() -> None:
    reader = TrtllmEventReader(instance_id="oe")
    reader.read([stored(1, event_id=2)], ts_ns=TS)
    (batch,) = reader.read([MARKER, stored(2), stored(3, event_id=9)], ts_ns=TS)
    assert [e.event_id for e in batch.events] == [7, 8, 9]
    assert isinstance(batch.events[0].data, Cleared)
    # no room before the next id (the engine's ids went backwards): continue from the last id
    (batch,) = reader.read([MARKER, stored(4, event_id=3)], ts_ns=TS)
    assert [e.event_id for e in batch.events] == [10, 3]


def test_numbering_state_round_trips() -> None:
    reader = TrtllmEventReader(instance_id="oe")
    reader.read([stored(1, event_id=4, window_size=64), stored(2, attention_dp_rank=3)], ts_ns=TS)
    state = json.loads(json.dumps(reader.numbering_state()))
    resumed = TrtllmEventReader(instance_id="oe")
    resumed.restore_numbering(state)
    assert ids(resumed.read([stored(3), stored(4, attention_dp_rank=3)], ts_ns=TS)) == [
        (None, [5]),
        (3, [1]),
    ]
    (batch,) = resumed.read([MARKER], ts_ns=TS)  # the largest window seen survives too
    assert batch.events[0].window_size == 64
    for bad in ({}, {"last_ids": [["x", 1]]}, {"last_ids": [[None, -1]]}, {"last_ids": 5}):
        with pytest.raises(ConfigError, match="numbering state"):
            resumed.restore_numbering(bad)


def test_fanout_marker_rank_zero_is_the_rankless_source_only_without_rank_zero() -> None:
    reader = TrtllmEventReader(instance_id="oe")
    marker0 = {"attention_dp_rank": 0, **MARKER}
    (batch,) = reader.read([stored(1, event_id=0), marker0, stored(2, event_id=5)], ts_ns=TS)
    assert batch.source.attention_dp_rank is None
    assert [e.event_id for e in batch.events] == [0, 4, 5]
    # with attention DP (rank 0 events exist) a rank-0 marker stays rank 0's
    dp = TrtllmEventReader(instance_id="dp")
    batches = dp.read([stored(1, event_id=0, attention_dp_rank=0), marker0], ts_ns=TS)
    assert ids(batches) == [(0, [0, 1])]
    # a lone marker with nothing seen is rank 0's, as stamped
    assert ids(TrtllmEventReader(instance_id="x").read([marker0], ts_ns=TS)) == [(0, [0])]


def test_window_zero_or_missing_is_unknown() -> None:
    (batch,) = from_trtllm_events([stored(1, event_id=0, window_size=0)], instance_id="x", ts_ns=TS)
    assert batch.events[0].window_size == UNBOUNDED_WINDOW
    (batch,) = from_trtllm_events(
        [stored(1, event_id=0, window_size=0)], instance_id="x", ts_ns=TS, default_window_size=32
    )
    assert batch.events[0].window_size == 32


# --------------------------------------------------------------------------------------------
# Tolerant reads
# --------------------------------------------------------------------------------------------


def test_read_tolerant_keeps_the_good_events_and_names_the_bad() -> None:
    reader = TrtllmEventReader(instance_id="oe")
    good = load("dynamo_adapter_minimal_tokens.json")
    events = [good[0], {"event_id": 5, "data": 7}, good[1], {"data": {"type": "evicted"}}, good[2]]
    result = reader.read_tolerant(events, ts_ns=TS)
    assert [str(e).split(":")[0] for e in result.errors] == ["event[1].data", "event[3].data.type"]
    assert ids(result.batches) == [(0, [1, 2]), (1, [1])]
    # the reader numbered on as if only the good events had come
    assert ids(reader.read([stored(9, attention_dp_rank=0)], ts_ns=TS)) == [(0, [3])]
    not_a_list = reader.read_tolerant({"event_id": 1}, ts_ns=TS)  # type: ignore[arg-type]
    assert not_a_list.batches == []
    assert [str(e).split(":")[0] for e in not_a_list.errors] == ["events"]


# --------------------------------------------------------------------------------------------
# The rules the new shapes brought, one by one
# --------------------------------------------------------------------------------------------


def one_block(**block: Any) -> StoredBlock:
    event = {
        "event_id": 0,
        "window_size": 16,
        "data": {
            "type": "stored",
            "blocks": [{"block_hash": 1, "tokens": [{"token_id": 1}], **block}],
        },
    }
    (batch,) = from_trtllm_events([event], instance_id="x", ts_ns=TS)
    data = batch.events[0].data
    assert isinstance(data, Stored)
    return data.blocks[0]


@pytest.mark.parametrize(
    ("hash_text", "first8"),
    [
        ("0123456789abcdef", "0123456789abcdef"),
        ("0123456789ABCDEF0011", "0123456789abcdef"),  # int(h[:16], 16)
        ("ff", "00000000000000ff"),
    ],
)
def test_short_hex_mm_hash_is_the_items_64_bit_hash(hash_text: str, first8: str) -> None:
    (key,) = one_block(mm_keys=[{"hash": hash_text, "start_offset": 1}]).mm_keys
    assert (key.hash.hex(), key.start_offset, key.uuid) == (first8 + "00" * 24, 1, None)


def test_mm_key_start_offset_defaults_to_zero() -> None:
    (key,) = one_block(mm_keys=[{"hash": "ab" * 32}]).mm_keys
    assert (key.hash, key.start_offset) == (bytes.fromhex("ab" * 32), 0)
    (key,) = one_block(mm_keys=[{"hash": "ab" * 32, "start_offset": None}]).mm_keys
    assert key.start_offset == 0


def test_64_bit_extra_id_digest_token() -> None:
    digest = bytes(range(10, 42))
    extra = int.from_bytes(digest[:8], "little")
    block = one_block(tokens=[{"token_id": 5}, {"token_id": 0, "token_extra_id": extra}])
    assert block.token_ids.tolist() == [5, 0]
    assert block.token_extra_ids is None  # dropped: it does not fit in uint32
    assert [(k.hash, k.start_offset) for k in block.mm_keys] == [(digest[:8] + bytes(24), 0)]
    # published mm_keys win over derived ones
    block = one_block(
        tokens=[{"token_id": 0, "token_extra_id": extra}],
        mm_keys=[{"hash": digest.hex(), "start_offset": 0}],
    )
    assert [k.hash for k in block.mm_keys] == [digest]
    # a uint32 extra id stays an extra id, also on token 0
    assert one_block(tokens=[{"token_id": 0, "token_extra_id": 7}]).token_extra_ids == [7]
    with pytest.raises(InteropError, match=r"token_extra_id: 18446744073709551616 is outside"):
        one_block(tokens=[{"token_id": 0, "token_extra_id": 2**64}])


def test_64_bit_extra_id_digest_with_an_mm_offset_continues_items() -> None:
    extra = int.from_bytes(bytes(range(8)), "little")
    event = {
        "event_id": 0,
        "window_size": 16,
        "data": {
            "type": "stored",
            "blocks": [
                {
                    "block_hash": 1,
                    "tokens": [
                        {"token_id": 0, "token_extra_id": extra},
                        {"token_id": 1001},
                        {"token_id": 3},
                    ],
                },
                {"block_hash": 2, "tokens": [{"token_id": 1002}, {"token_id": 4}]},
            ],
        },
    }
    (batch,) = from_trtllm_events([event], instance_id="x", ts_ns=TS, mm_token_id_offset=1000)
    data = batch.events[0].data
    assert isinstance(data, Stored)
    item = bytes(range(8)) + bytes(24)
    assert [[(k.hash, k.start_offset) for k in b.mm_keys] for b in data.blocks] == [
        [(item, 0)],
        [(item, 2)],
    ]


def test_data_level_lora_and_salt_fill_blocks_without_their_own() -> None:
    event = {
        "event_id": 0,
        "window_size": 16,
        "data": {
            "type": "stored",
            "lora_id": 3,
            "lora_name": "adapter",
            "cache_salt": "tenant",
            "blocks": [
                {"block_hash": 1, "tokens": [{"token_id": 1}]},
                {
                    "block_hash": 2,
                    "tokens": [{"token_id": 2}],
                    "lora_id": 4,
                    "lora_name": "other",
                    "cache_salt": "own",
                },
            ],
        },
    }
    (batch,) = from_trtllm_events([event], instance_id="x", ts_ns=TS)
    data = batch.events[0].data
    assert isinstance(data, Stored)
    assert [(b.lora_id, b.lora_name, b.cache_salt) for b in data.blocks] == [
        (3, "adapter", "tenant"),
        (4, "other", "own"),
    ]
    event["data"]["cache_salt"] = 5
    with pytest.raises(InteropError, match=r"^event\[0\]\.data\.cache_salt: expected a string"):
        from_trtllm_events([event], instance_id="x", ts_ns=TS)

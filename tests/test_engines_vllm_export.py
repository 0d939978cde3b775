"""kvstream.engines.vllm_export: kvstream batches -> vLLM KVEventBatch msgpack (no sockets)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.engines.vllm import decode_payload
from kvstream.engines.vllm_export import MEDIUM_BY_LEVEL, VllmExporter, medium_of, wire_hash
from kvstream.errors import ConfigError, InteropError
from kvstream.events.model import (
    UNBOUNDED_WINDOW,
    AttentionKind,
    Cleared,
    Created,
    EventBatch,
    EventData,
    EventDiff,
    KVCacheEvent,
    Lost,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
    Updated,
)

# peers.md §1.2: a map-era batch with one BlockStored (hash V3a) as vLLM 0.24 encodes it, and
# BlockRemoved + AllBlocksCleared. vLLM 0.33's BlockStored declares 16 keys, so msgspec gives it
# a map16 header (de 000a) where 0.24's had a fixmap (8a); VLLM_033_STORED is vLLM 0.33.0's own
# encoder's output for the same batch (KVEventBatch(ts=0.0, [BlockStored(...)], 0)).
MAP_ERA_024 = bytes.fromhex(
    "93cb0000000000000000918aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf"
    "84b146b151d55111b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa62"
    "6c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a96772"
    "6f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00"
)
VLLM_033_STORED = bytes.fromhex(
    "93cb000000000000000091de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
    "91cf84b146b151d55111b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304"
    "aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a9"
    "67726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e"
    "00"
)
REMOVED_CLEARED = bytes.fromhex(
    "93cb00000000000000009284a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391"
    "cf84b146b151d55111a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f"
    "636b73436c656172656400"
)
V3A = 9561501211280363793
ALGO = "vllm_sha256_cbor_64"


def h8(n: int) -> bytes:
    return n.to_bytes(8, "big")


def ev(
    data: EventData,
    *,
    event_id: int = 0,
    group: int = 0,
    window: int = UNBOUNDED_WINDOW,
    algo: str = ALGO,
) -> KVCacheEvent:
    return KVCacheEvent(
        event_id=event_id, hash_algo=algo, layer_group_id=group, window_size=window, data=data
    )


def batch(
    *events: KVCacheEvent,
    instance: str = "w0",
    rank: int | None = None,
    incarnation: int = 0,
    ts_ns: int = 0,
) -> EventBatch:
    return EventBatch(
        source=SourceId(instance_id=instance, attention_dp_rank=rank, incarnation=incarnation),
        ts_ns=ts_ns,
        events=events,
    )


def block(n: int, tokens: list[int] | None = None, **kw: Any) -> StoredBlock:
    return StoredBlock(block_hash=h8(n), token_ids=tokens or [n, n, n, n], **kw)


def stored(*blocks: StoredBlock, parent: bytes | None = None) -> Stored:
    return Stored(parent_hash=parent, blocks=blocks)


def wire(exporter: VllmExporter, b: EventBatch, **kw: Any) -> list[Any]:
    """The decoded payload ``[ts, [event maps], rank]`` (by field name, as a consumer reads)."""
    out = exporter.encode(b, **kw)
    assert out.payload is not None
    decoded = msgspec.msgpack.decode(out.payload)
    assert out.events == len(decoded[1])
    return list(decoded)


def events_of(exporter: VllmExporter, b: EventBatch) -> list[dict[str, Any]]:
    return list(wire(exporter, b)[1])


# --------------------------------------------------------------------- reference bytes


def test_stored_matches_vllm_reference_bytes() -> None:
    b = batch(ev(stored(StoredBlock(block_hash=h8(V3A), token_ids=[1, 2, 3, 4]))))
    payload = VllmExporter().encode(b).payload
    assert payload is not None
    # VLLM_033_STORED is vLLM's encoder on a struct built without extra_keys; vLLM's block
    # pool always fills them (one nil per key-less block), and so does the exporter: the same
    # bytes but for that key (test_vllm_export_golden holds whole captured frames equal)
    head = VLLM_033_STORED.index(b"\xa9group_idx")
    added = b"\xaaextra_keys\x91\xc0"
    # one more key in the map16 header (00 0a -> 00 0b), the key before group_idx
    expected = VLLM_033_STORED[:13] + b"\x0b" + VLLM_033_STORED[14:head] + added
    assert payload == expected + VLLM_033_STORED[head:]
    # the same keys and values as 0.24's encoding; only the map header's width differs
    decoded = msgspec.msgpack.decode(payload)
    assert decoded[1][0].pop("extra_keys") == [None]
    assert decoded == msgspec.msgpack.decode(MAP_ERA_024)


def test_removed_and_cleared_match_vllm_reference_bytes() -> None:
    b = batch(
        ev(Removed(block_hashes=(h8(V3A),), cache_level=0)),
        ev(Cleared(), event_id=1),
    )
    assert VllmExporter().encode(b).payload == REMOVED_CLEARED


def test_batch_envelope_carries_ts_and_rank() -> None:
    b = batch(ev(stored(block(1))), rank=3, ts_ns=1_500_000_000)
    ts, events, rank = wire(VllmExporter(), b)
    assert (ts, rank, len(events)) == (1.5, 3, 1)
    # the publisher may stamp its own rank; None means rank 0, as vLLM's publisher stamps it
    assert wire(VllmExporter(), b, dp_rank=1)[2] == 1
    assert wire(VllmExporter(), batch(ev(stored(block(1)))))[2] == 0


# ------------------------------------------------------------------------------ stored


def test_stored_chain_concatenates_tokens_and_keeps_parent() -> None:
    b = batch(ev(stored(block(1, [1, 2, 3, 4]), block(2, [5, 6, 7, 8]), parent=h8(99)), group=2))
    [e] = events_of(VllmExporter(), b)
    assert e == {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": 99,
        "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 2,
        "kv_cache_spec_kind": "full_attention",
    }


def test_blocks_of_different_sizes_split_into_chained_events() -> None:
    blocks = (block(1, [1, 2, 3, 4]), block(2, [5, 6, 7, 8]), block(3, [9, 10]), block(4, [11]))
    got = events_of(VllmExporter(), batch(ev(stored(*blocks))))
    assert [(e["block_hashes"], e["parent_block_hash"], e["block_size"]) for e in got] == [
        ([1, 2], None, 4),
        ([3], 2, 2),
        ([4], 3, 1),
    ]
    assert [e["token_ids"] for e in got] == [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10], [11]]


def test_lora_and_tier_changes_split_events() -> None:
    blocks = (
        block(1, lora_id=7, lora_name="ad"),
        block(2, lora_id=7, lora_name="ad"),
        block(3, cache_level=1),
        block(4, cache_level=2),
    )
    got = events_of(VllmExporter(), batch(ev(stored(*blocks))))
    assert [
        (e["block_hashes"], e["parent_block_hash"], e["lora_id"], e["lora_name"], e["medium"])
        for e in got
    ] == [
        ([1, 2], None, 7, "ad", "GPU"),
        ([3], 2, None, None, "CPU"),
        ([4], 3, None, None, "STORAGE"),
    ]


@pytest.mark.parametrize(
    ("level", "medium"), [(0, "GPU"), (1, "CPU"), (2, "STORAGE"), (3, "EXTERNAL"), (9, "EXTERNAL")]
)
def test_medium_of_each_cache_level(level: int, medium: str) -> None:
    assert medium_of(level) == medium
    [e] = events_of(VllmExporter(), batch(ev(stored(block(1, cache_level=level)))))
    assert e["medium"] == medium


def test_medium_names_are_ones_the_vllm_decoder_knows() -> None:
    from kvstream.engines.vllm import MEDIUM_LEVELS

    assert all(MEDIUM_LEVELS[m] == level for level, m in MEDIUM_BY_LEVEL.items())
    assert medium_of(None) is None


def test_extra_keys_verbatim_one_entry_per_block() -> None:
    blocks = (
        block(1, extra_keys=("my-lora", ("img-1", 0), "salt")),
        block(2),
        block(3, extra_keys=(b"\x01" * 32,)),
    )
    [e] = events_of(VllmExporter(), batch(ev(stored(*blocks))))
    assert e["extra_keys"] == [["my-lora", ["img-1", 0], "salt"], None, [b"\x01" * 32]]


def test_blocks_without_extra_keys_get_one_nil_each() -> None:
    # what vLLM 0.33's block pool publishes (extra_keys=[None, None]), not an omitted field
    [e] = events_of(VllmExporter(), batch(ev(stored(block(1), block(2)))))
    assert e["extra_keys"] == [None, None]


# ----------------------------------------------------------------- attention kind/window


def test_finite_window_without_created_has_no_kind() -> None:
    [e] = events_of(VllmExporter(), batch(ev(stored(block(1)), window=4096)))
    assert "kv_cache_spec_kind" not in e
    assert "kv_cache_spec_sliding_window" not in e


def test_created_sets_the_group_kind_and_is_not_published() -> None:
    x = VllmExporter()
    created = batch(
        ev(Created(num_blocks_per_cache_level=(10,), tokens_per_block=4), group=0, window=8192),
        ev(
            Created(
                num_blocks_per_cache_level=(10,),
                tokens_per_block=4,
                attention_kind=AttentionKind.SLIDING_WINDOW,
            ),
            event_id=1,
            group=1,
            window=512,
        ),
    )
    out = x.encode(created)
    assert (out.payload, out.events) == (None, 0)
    assert x.unmapped == {"created": 2}
    got = events_of(
        x,
        batch(
            ev(stored(block(1)), event_id=2, group=0, window=8192),
            ev(stored(block(1)), event_id=3, group=1, window=512),
        ),
    )
    assert [(e["group_idx"], e["kv_cache_spec_kind"]) for e in got] == [
        (0, "full_attention"),
        (1, "sliding_window"),
    ]
    assert "kv_cache_spec_sliding_window" not in got[0]
    assert got[1]["kv_cache_spec_sliding_window"] == 512
    # state is per source: another instance has not announced its groups
    [other] = events_of(x, batch(ev(stored(block(1)), group=1, window=512), instance="w1"))
    assert "kv_cache_spec_kind" not in other


# ------------------------------------------------------------------------------ hashes


def test_wire_hash_forms() -> None:
    digest = bytes(range(32))
    assert wire_hash(h8(2**64 - 1)) == 2**64 - 1
    assert wire_hash(h8(5), "bytes") == 5  # 64-bit hashes stay ints in both formats
    assert wire_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert wire_hash(digest, "bytes") == digest


@pytest.mark.parametrize("fmt", ["int", "bytes"])
def test_256_bit_hashes_per_format(fmt: Any) -> None:
    d1, d2, parent = b"\x11" * 32, b"\x22" * 24 + h8(2**63 + 5), b"\x33" * 32
    b = batch(
        ev(
            stored(
                StoredBlock(block_hash=d1, token_ids=[1]),
                StoredBlock(block_hash=d2, token_ids=[2]),
                parent=parent,
            ),
            algo="v2_sha256",
        ),
        ev(Removed(block_hashes=(d1,)), event_id=1, algo="v2_sha256"),
    )
    out = VllmExporter(hash_format=fmt).encode(b).payload
    assert out is not None
    s, r = msgspec.msgpack.decode(out)[1]
    if fmt == "int":
        assert s["block_hashes"] == [int.from_bytes(d1[-8:], "big"), 2**63 + 5]
        assert s["parent_block_hash"] == int.from_bytes(parent[-8:], "big")
        assert r["block_hashes"] == [int.from_bytes(d1[-8:], "big")]
        assert b"\xcf" + h8(2**63 + 5) in out  # msgpack uint64, as vLLM sends it
    else:
        assert s["block_hashes"] == [d1, d2]
        assert s["parent_block_hash"] == parent
        assert r["block_hashes"] == [d1]


# ----------------------------------------------------------------------------- removed


def test_removed_medium_from_event_or_last_known_tier() -> None:
    x = VllmExporter()
    x.encode(batch(ev(stored(block(1), block(2, cache_level=1)))))
    got = events_of(x, batch(ev(Removed(block_hashes=(h8(1), h8(2), h8(3))), event_id=1, group=0)))
    # block 1 was last seen on the GPU, block 2 on the host, block 3 never: three runs
    assert [(e["block_hashes"], e["medium"], e["group_idx"]) for e in got] == [
        ([1], "GPU", 0),
        ([2], "CPU", 0),
        ([3], None, 0),
    ]
    # forgotten after the removal: the tier is unknown from now on
    [again] = events_of(x, batch(ev(Removed(block_hashes=(h8(2),)), event_id=2)))
    assert again["medium"] is None


def test_removed_with_cache_level_keeps_a_copy_on_another_tier() -> None:
    x = VllmExporter()
    x.encode(batch(ev(stored(block(1)))))
    x.encode(batch(ev(stored(block(1, cache_level=1)), event_id=1)))  # a CPU copy (vLLM offload)
    [gpu] = events_of(x, batch(ev(Removed(block_hashes=(h8(1),), cache_level=0), event_id=2)))
    assert gpu["medium"] == "GPU"
    [last] = events_of(x, batch(ev(Removed(block_hashes=(h8(1),)), event_id=3)))
    assert last["medium"] == "CPU"


# ----------------------------------------------------------------------------- updated


def move(n: int, old: int, new: int, event_id: int = 1, group: int = 0) -> KVCacheEvent:
    diff = EventDiff(old_value=old, new_value=new)
    return ev(Updated(block_hash=h8(n), cache_level=diff), event_id=event_id, group=group)


def test_tier_move_of_a_known_block_is_stored_then_removed() -> None:
    x = VllmExporter()
    x.encode(
        batch(
            ev(
                stored(
                    block(1, [1, 2, 3, 4]),
                    block(2, [5, 6, 7, 8], lora_id=3, lora_name="l", extra_keys=("l",)),
                    parent=h8(50),
                ),
                group=1,
            )
        )
    )
    stored_ev, removed_ev = events_of(x, batch(move(2, 0, 1, group=1)))
    assert stored_ev == {
        "type": "BlockStored",
        "block_hashes": [2],
        "parent_block_hash": 1,
        "token_ids": [5, 6, 7, 8],
        "block_size": 4,
        "lora_id": 3,
        "medium": "CPU",
        "lora_name": "l",
        "extra_keys": [["l"]],
        "group_idx": 1,
        "kv_cache_spec_kind": "full_attention",
    }
    assert removed_ev == {
        "type": "BlockRemoved",
        "block_hashes": [2],
        "medium": "GPU",
        "group_idx": 1,
    }
    # the exporter follows the move: a later removal without a level leaves the host tier
    [gone] = events_of(x, batch(ev(Removed(block_hashes=(h8(2),)), event_id=2, group=1)))
    assert gone["medium"] == "CPU"


def test_tier_move_of_an_unknown_block_is_a_placeholder() -> None:
    x = VllmExporter()
    stored_ev, removed_ev = events_of(x, batch(move(7, 1, 2)))
    assert stored_ev == {
        "type": "BlockStored",
        "block_hashes": [7],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": "STORAGE",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    assert (removed_ev["type"], removed_ev["medium"]) == ("BlockRemoved", "CPU")
    assert x.unmapped == {"tier_move_without_tokens": 1}


def test_priority_only_update_has_no_wire_form() -> None:
    x = VllmExporter()
    upd = Updated(block_hash=h8(1), priority=EventDiff(old_value=35, new_value=80))
    out = x.encode(batch(ev(upd)))
    assert (out.payload, out.events) == (None, 0)
    assert x.unmapped == {"priority_update": 1}


def test_block_tracking_is_bounded() -> None:
    x = VllmExporter(track_blocks=2)
    x.encode(batch(ev(stored(block(1), block(2), block(3)))))
    # block 1 was forgotten (oldest), 2 and 3 are remembered
    first = events_of(x, batch(move(1, 0, 1)))[0]
    third = events_of(x, batch(move(3, 0, 1, event_id=2)))[0]
    assert (first["block_size"], third["block_size"]) == (0, 4)
    off = VllmExporter(track_blocks=0)
    off.encode(batch(ev(stored(block(1)))))
    assert events_of(off, batch(move(1, 0, 1)))[0]["token_ids"] == []


# ---------------------------------------------------------------- cleared, lost, restarts


def test_cleared_and_lost_become_one_all_blocks_cleared() -> None:
    x = VllmExporter()
    got = events_of(
        x,
        batch(
            ev(stored(block(1)), event_id=0),
            ev(Cleared(), event_id=1, group=0),
            ev(Cleared(), event_id=2, group=1),
            ev(Lost(first_event_id=3, count=4), event_id=6),
            ev(stored(block(2)), event_id=7),
        ),
    )
    assert [e["type"] for e in got] == ["BlockStored", "AllBlocksCleared", "BlockStored"]
    assert got[1] == {"type": "AllBlocksCleared"}
    # lost forgets what was known about the source's blocks
    assert events_of(x, batch(move(1, 0, 1, event_id=8)))[0]["block_size"] == 0


def test_cleared_forgets_only_its_group() -> None:
    x = VllmExporter()
    x.encode(batch(ev(stored(block(1)), group=0), ev(stored(block(1)), event_id=1, group=1)))
    x.encode(batch(ev(Cleared(), event_id=2, group=0)))
    assert events_of(x, batch(move(1, 0, 1, event_id=3, group=0)))[0]["block_size"] == 0
    assert events_of(x, batch(move(1, 0, 1, event_id=4, group=1)))[0]["block_size"] == 4


def test_new_incarnation_starts_with_all_blocks_cleared() -> None:
    x = VllmExporter()
    first = x.encode(batch(ev(stored(block(1)))))
    assert not first.restarted
    again = x.encode(batch(ev(stored(block(2)), event_id=1)))
    assert not again.restarted
    new = x.encode(batch(ev(stored(block(3))), incarnation=5))
    assert new.restarted
    assert new.payload is not None
    types = [e["type"] for e in msgspec.msgpack.decode(new.payload)[1]]
    assert types == ["AllBlocksCleared", "BlockStored"]
    # even a batch with nothing else to say carries the clear
    newer = x.encode(batch(incarnation=6))
    assert (newer.restarted, newer.events) == (True, 1)


def test_older_incarnation_is_refused() -> None:
    x = VllmExporter()
    x.encode(batch(ev(stored(block(1))), incarnation=3))
    with pytest.raises(InteropError, match="incarnation 2 is older than 3"):
        x.encode(batch(ev(stored(block(2))), incarnation=2))
    # forget() starts the source afresh
    x.forget("w0", None)
    assert not x.encode(batch(ev(stored(block(2))), incarnation=2)).restarted


def test_new_incarnation_forgets_group_kinds() -> None:
    x = VllmExporter()
    sw = Created(
        num_blocks_per_cache_level=(4,),
        tokens_per_block=4,
        attention_kind=AttentionKind.SLIDING_WINDOW,
    )
    x.encode(batch(ev(sw, window=64)))
    new = events_of(x, batch(ev(stored(block(1)), window=64), incarnation=1))
    assert [e["type"] for e in new] == ["AllBlocksCleared", "BlockStored"]
    assert "kv_cache_spec_kind" not in new[1]


def test_bad_settings() -> None:
    with pytest.raises(ConfigError, match="hash_format"):
        VllmExporter(hash_format="hex")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="track_blocks"):
        VllmExporter(track_blocks=-1)


# ---------------------------------------------------- round trip through kvstream's decoder

_blocks = st.lists(
    st.tuples(
        st.integers(0, 2**64 - 1),
        st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=5),
        st.sampled_from([None, "a", "b"]),
        st.integers(0, 3),
        st.one_of(st.none(), st.tuples(st.text(max_size=3), st.integers(0, 9))),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(_blocks, st.one_of(st.none(), st.integers(0, 2**64 - 1)), st.integers(0, 3))
def test_stored_round_trips_through_the_vllm_decoder(
    spec: list[tuple[int, list[int], str | None, int, tuple[str, int] | None]],
    parent: int | None,
    group: int,
) -> None:
    blocks = tuple(
        StoredBlock(
            block_hash=h8(h),
            token_ids=toks,
            lora_name=lora,
            cache_level=level,
            extra_keys=None if extra is None else (extra,),
        )
        for h, toks, lora, level, extra in spec
    )
    b = batch(ev(stored(*blocks, parent=None if parent is None else h8(parent)), group=group))
    payload = VllmExporter().encode(b).payload
    assert payload is not None
    decoded = decode_payload(payload, width=8)
    assert all(w.kind == "stored" and w.group == group for w in decoded.events)
    hashes = [h for w in decoded.events for h in w.block_hashes]
    assert hashes == [blk.block_hash for blk in blocks]
    tokens = [list(t) for w in decoded.events for t in w.block_tokens]
    assert tokens == [blk.token_ids.tolist() for blk in blocks]
    per_block = [
        (w.cache_level, w.lora_name) for w in decoded.events for _ in range(len(w.block_hashes))
    ]
    assert per_block == [(blk.cache_level, blk.lora_name) for blk in blocks]
    extras = [
        None if x is None else tuple(x)
        for w in decoded.events
        for x in (w.extra_keys or (None,) * len(w.block_hashes))
    ]
    assert extras == [blk.extra_keys for blk in blocks]
    # each event's parent is the block before its first one
    expected_parent = b.events[0].data.parent_hash  # type: ignore[union-attr]
    for w in decoded.events:
        assert w.parent_hash == expected_parent
        expected_parent = w.block_hashes[-1]

"""The typed event model: validation names the field, values round-trip, hashes have widths."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstream._types import (
    TOKEN_ID_MAX,
    CacheLevel,
    TokenIds,
    hash_from_hex,
    hash_from_int,
    hash_to_hex,
    hash_to_int,
)
from kvstream.errors import EventValidationError, KVStreamError
from kvstream.events import (
    AttentionKind,
    Cleared,
    Created,
    EventBatch,
    EventDiff,
    EventKind,
    KVCacheEvent,
    Lost,
    MmKey,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
    Updated,
)

H8 = bytes(range(8))
H32 = bytes(range(32))


def _block(h: bytes = H8, **kw: object) -> StoredBlock:
    return StoredBlock(block_hash=h, token_ids=[1, 2, 3, 4], **kw)  # type: ignore[arg-type]


def _batch(*events: KVCacheEvent) -> EventBatch:
    return EventBatch(
        source=SourceId(instance_id="w0", attention_dp_rank=1), ts_ns=5, events=events
    )


class TestHashHelpers:
    def test_int_round_trip_beyond_int64(self) -> None:
        v = 10011707017105896989  # > 2**63, a real v1_block_key value
        assert hash_to_int(hash_from_int(v)) == v

    def test_signed_wire_form_wraps(self) -> None:
        # TensorRT-LLM's ZMQ/gRPC wire carries the signed int64 form of the same hash.
        assert hash_from_int(-8435037056603654627) == hash_from_int(10011707017105896989)

    @pytest.mark.parametrize("bad", [2**64, -(2**63) - 1])
    def test_out_of_range(self, bad: int) -> None:
        with pytest.raises(ValueError, match="does not fit"):
            hash_from_int(bad)

    def test_hex(self) -> None:
        assert hash_from_hex(hash_to_hex(H32)) == H32
        with pytest.raises(ValueError, match="non-hexadecimal"):
            hash_from_hex("zz")

    @given(st.integers(0, 2**64 - 1))
    def test_int_bytes_property(self, v: int) -> None:
        b = hash_from_int(v)
        assert len(b) == 8
        assert hash_to_int(b) == v


class TestTokenIds:
    def test_behaves_like_a_tuple(self) -> None:
        t = TokenIds([5, 6, 7, 8])
        assert len(t) == 4
        assert t[0] == 5
        assert t[-1] == 8
        assert t == [5, 6, 7, 8]
        assert t == (5, 6, 7, 8)
        assert t[1:3] == TokenIds([6, 7])
        assert t[::2] == [5, 7]
        assert list(t) == [5, 6, 7, 8]
        assert t + TokenIds([9]) == [5, 6, 7, 8, 9]
        assert hash(t) == hash(TokenIds((5, 6, 7, 8)))
        with pytest.raises(IndexError):
            t[4]

    def test_raw_is_little_endian_u32(self) -> None:
        assert TokenIds([1, 0x01020304]).raw == b"\x01\x00\x00\x00\x04\x03\x02\x01"
        assert TokenIds.from_bytes(TokenIds([7, 8]).raw) == [7, 8]
        with pytest.raises(ValueError, match="multiple of 4"):
            TokenIds.from_bytes(b"\x00\x01\x02")

    @pytest.mark.parametrize("bad", [[-1], [TOKEN_ID_MAX + 1]])
    def test_range(self, bad: list[int]) -> None:
        with pytest.raises(ValueError, match="token ids"):
            TokenIds(bad)

    def test_accepts_array_and_range(self) -> None:
        assert TokenIds(array("I", [1, 2])) == TokenIds(range(1, 3))

    def test_bytes_are_not_ints(self) -> None:
        with pytest.raises(TypeError, match="from_bytes"):
            TokenIds(b"\x00\x00\x00\x00")

    @given(st.lists(st.integers(0, TOKEN_ID_MAX), max_size=50))
    def test_list_round_trip(self, ids: list[int]) -> None:
        assert TokenIds(ids).tolist() == ids


class TestValidationNamesTheField:
    def test_is_a_kvstream_error_and_value_error(self) -> None:
        with pytest.raises(EventValidationError) as ei:
            KVCacheEvent(event_id=-1, window_size=4, data=Cleared())
        assert isinstance(ei.value, KVStreamError)
        assert isinstance(ei.value, ValueError)
        assert "event_id" in str(ei.value)
        assert ei.value.errors[0]["loc"] == "event_id"

    @pytest.mark.parametrize(
        ("kwargs", "field"),
        [
            ({"priority": 101}, "priority"),
            ({"priority": -1}, "priority"),
            ({"cache_level": -1}, "cache_level"),
            ({"token_ids": [-5]}, "token_ids"),
            ({"token_ids": "1234"}, "token_ids"),
            ({"lora_id": -1}, "lora_id"),
            ({"block_hash": "00" * 8}, "block_hash"),  # hex text is not bytes
            ({"block_hash": b""}, "block_hash"),
            ({"token_extra_ids": [0, 0]}, "token_extra_ids"),
            ({"unknown_field": 1}, "unknown_field"),
        ],
    )
    def test_stored_block(self, kwargs: dict[str, object], field: str) -> None:
        args: dict[str, object] = {"block_hash": H8, "token_ids": [1, 2, 3]}
        args.update(kwargs)
        with pytest.raises(EventValidationError, match=field):
            StoredBlock(**args)  # type: ignore[arg-type]

    def test_stored_needs_blocks(self) -> None:
        with pytest.raises(EventValidationError, match="blocks"):
            Stored(blocks=())

    def test_removed_needs_hashes(self) -> None:
        with pytest.raises(EventValidationError, match="block_hashes"):
            Removed(block_hashes=())

    def test_lost_needs_positive_count(self) -> None:
        with pytest.raises(EventValidationError, match="count"):
            Lost(first_event_id=0, count=0)

    def test_updated_must_change_something(self) -> None:
        with pytest.raises(EventValidationError, match="must change"):
            Updated(block_hash=H8)
        with pytest.raises(EventValidationError, match="priority"):
            Updated(block_hash=H8, priority=EventDiff(old_value=35, new_value=101))

    def test_hash_width_must_match_algorithm(self) -> None:
        with pytest.raises(EventValidationError, match=r"data.blocks.0.block_hash.*32 bytes"):
            KVCacheEvent(
                event_id=0, hash_algo="v2_sha256", window_size=4, data=Stored(blocks=(_block(),))
            )
        with pytest.raises(EventValidationError, match="parent_hash"):
            KVCacheEvent(
                event_id=0,
                hash_algo="v2_sha256",
                window_size=4,
                data=Stored(parent_hash=H8, blocks=(_block(H32),)),
            )

    def test_unknown_algorithm_needs_consistent_widths(self) -> None:
        ok = KVCacheEvent(
            event_id=0, hash_algo="future_algo", window_size=4, data=Removed(block_hashes=(H32,))
        )
        assert ok.hash_algo == "future_algo"
        with pytest.raises(EventValidationError, match="32 bytes"):
            KVCacheEvent(
                event_id=0,
                hash_algo="future_algo",
                window_size=4,
                data=Removed(block_hashes=(H32, H8)),
            )

    def test_unknown_kind(self) -> None:
        with pytest.raises(EventValidationError, match="does not match any of the expected tags"):
            KVCacheEvent.model_validate({"event_id": 0, "window_size": 4, "data": {"type": "x"}})

    def test_batch_errors_carry_nested_paths(self) -> None:
        with pytest.raises(EventValidationError) as ei:
            EventBatch.model_validate(
                {
                    "source": {"instance_id": ""},
                    "ts_ns": 0,
                    "events": [{"event_id": 0, "window_size": 0, "data": {"type": "cleared"}}],
                }
            )
        locs = {e["loc"] for e in ei.value.errors}
        assert {"source.instance_id", "events.0.window_size"} <= locs

    def test_frozen(self) -> None:
        b = _block()
        with pytest.raises(Exception, match="frozen"):
            b.priority = 1  # type: ignore[misc]


class TestShapes:
    def test_every_kind(self) -> None:
        events = [
            KVCacheEvent(
                event_id=0,
                window_size=128,
                data=Created(
                    num_blocks_per_cache_level=(100, 50, 0),
                    tokens_per_block=4,
                    attention_kind=AttentionKind.SLIDING_WINDOW,
                ),
            ),
            KVCacheEvent(
                event_id=1,
                window_size=128,
                data=Stored(
                    blocks=(
                        _block(
                            mm_keys=(MmKey(hash=H32, start_offset=3, uuid="img-1"),),
                            cache_salt="tenant-a",
                            lora_id=7,
                            cache_level=CacheLevel.HOST,
                        ),
                    )
                ),
            ),
            KVCacheEvent(event_id=2, window_size=128, data=Removed(block_hashes=(H8,))),
            KVCacheEvent(
                event_id=3,
                window_size=128,
                data=Updated(block_hash=H8, cache_level=EventDiff(old_value=0, new_value=1)),
            ),
            KVCacheEvent(event_id=4, window_size=128, data=Cleared()),
            KVCacheEvent(event_id=5, window_size=128, data=Lost(first_event_id=5, count=1)),
        ]
        batch = _batch(*events)
        assert [e.kind for e in batch.events] == list(EventKind)
        assert EventBatch.model_validate_json(batch.model_dump_json()) == batch
        assert EventBatch.model_validate(batch.model_dump()) == batch
        keys = list(batch.event_keys())
        assert keys[0] == ("w0", 1, 0, 0)
        assert keys[-1] == ("w0", 1, 0, 5)

    def test_json_hashes_are_hex(self) -> None:
        ev = KVCacheEvent(event_id=0, window_size=4, data=Removed(block_hashes=(H8,)))
        assert '"0001020304050607"' in ev.model_dump_json()

    def test_defaults(self) -> None:
        ev = KVCacheEvent(event_id=0, window_size=4, data=Cleared())
        assert ev.hash_algo == "v1_block_key"
        assert ev.layer_group_id == 0
        b = _block()
        assert b.priority == 35
        assert b.cache_level == 0
        assert b.mm_keys == ()
        assert SourceId(instance_id="x").key == ("x", None)

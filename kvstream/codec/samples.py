"""Small example batches covering every event kind and layout branch.

Used by the compatibility checker for its fastavro round trips (the union branches taken
depend on the data, so the samples exercise each of them) and handy in tests and examples.
"""

from __future__ import annotations

from kvstream._types import TokenIds
from kvstream.events.model import (
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

__all__ = ["sample_batches"]


def _h8(i: int) -> bytes:
    return (0x9E3779B97F4A7C15 * (i + 1) % 2**64).to_bytes(8, "big")


def _h32(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(32))


def _tokens(start: int, n: int, step: int = 1) -> TokenIds:
    return TokenIds([(start + k * step) % 2**32 for k in range(n)])


def sample_batches() -> list[EventBatch]:
    """A few batches: every kind, 8- and 32-byte hashes, uniform and per-block attributes,
    partial and irregular blocks, multimodal keys, extra token ids, large token ids, engine
    extra keys of every shape (absent, empty, scalars and tuples, integers beyond a long)."""
    plain = EventBatch(
        source=SourceId(instance_id="worker-0", attention_dp_rank=1, incarnation=7),
        ts_ns=1_700_000_000_000_000_000,
        events=(
            KVCacheEvent(
                event_id=0,
                window_size=4096,
                data=Created(num_blocks_per_cache_level=(4096, 1024), tokens_per_block=4),
            ),
            KVCacheEvent(
                event_id=1,
                window_size=4096,
                data=Stored(
                    parent_hash=None,
                    blocks=(
                        StoredBlock(block_hash=_h8(1), token_ids=_tokens(1, 4)),
                        StoredBlock(block_hash=_h8(2), token_ids=_tokens(5, 4)),
                        StoredBlock(block_hash=_h8(3), token_ids=_tokens(9, 2)),
                    ),
                ),
            ),
            KVCacheEvent(event_id=2, window_size=4096, data=Removed(block_hashes=(_h8(3),))),
            KVCacheEvent(
                event_id=3,
                window_size=4096,
                data=Updated(block_hash=_h8(2), cache_level=EventDiff(old_value=0, new_value=1)),
            ),
        ),
    )
    rich = EventBatch(
        source=SourceId(instance_id="worker-1", incarnation=2**40),
        ts_ns=1,
        events=(
            KVCacheEvent(
                event_id=10,
                hash_algo="v2_sha256",
                layer_group_id=1,
                window_size=128,
                data=Created(
                    num_blocks_per_cache_level=(100, 200, 300),
                    tokens_per_block=32,
                    attention_kind=AttentionKind.SLIDING_WINDOW,
                ),
            ),
            KVCacheEvent(
                event_id=11,
                hash_algo="v2_sha256",
                layer_group_id=1,
                window_size=128,
                data=Stored(
                    parent_hash=_h32(0),
                    blocks=(
                        StoredBlock(
                            block_hash=_h32(1),
                            token_ids=_tokens(2**32 - 3, 3),
                            token_extra_ids=TokenIds([0, 5, 2**32 - 1]),
                            lora_id=2**64 - 1,
                            lora_name="adapter-a",
                            cache_level=1,
                            priority=90,
                            mm_keys=(MmKey(hash=_h32(9), start_offset=3, uuid="img-1"),),
                            cache_salt="tenant-a",
                            extra_keys=(
                                "adapter-a",
                                ("img-1", -3),
                                "tenant-a",
                                _h32(11),
                                2**64 - 1,
                                -(2**63),
                                2**63 - 1,
                                ("u64", 2**63, b""),
                                (),
                            ),
                        ),
                        StoredBlock(
                            block_hash=_h32(2),
                            token_ids=_tokens(70_000, 5, 1000),
                            lora_id=7,
                            cache_salt="tenant-a",
                            mm_keys=(
                                MmKey(hash=_h32(9), start_offset=0),
                                MmKey(hash=_h32(10), start_offset=12),
                            ),
                        ),
                        StoredBlock(block_hash=_h32(3), token_ids=(), extra_keys=()),
                    ),
                ),
            ),
            KVCacheEvent(
                event_id=12,
                hash_algo="v2_sha256",
                layer_group_id=1,
                window_size=128,
                data=Removed(block_hashes=(_h32(1), _h32(2)), cache_level=2),
            ),
            KVCacheEvent(
                event_id=13,
                hash_algo="v2_sha256",
                layer_group_id=1,
                window_size=128,
                data=Updated(
                    block_hash=_h32(3),
                    cache_level=EventDiff(old_value=1, new_value=2),
                    priority=EventDiff(old_value=35, new_value=0),
                ),
            ),
            KVCacheEvent(event_id=14, window_size=4096, data=Cleared()),
            KVCacheEvent(
                event_id=15,
                window_size=4096,
                data=Lost(first_event_id=3, count=7, reason="overflow"),
            ),
        ),
    )
    empty = EventBatch(source=SourceId(instance_id="w"), ts_ns=0)
    return [plain, rich, empty]

"""Record what a paged KV cache does into an EventEmitter and take one iteration's batch.

Shows the emission rules: a chain of stored blocks coalesces into one event, a reused
prefix emits nothing, removals are batched per window and precede the next store.

Run: python examples/emit_events.py
"""

from __future__ import annotations

from kvstream.events import AttentionKind, EventEmitter, SourceId
from kvstream.hashing import get_hasher


def main() -> None:
    emitter = EventEmitter(SourceId(instance_id="worker-0"), hash_algo="v2_sha256")
    hasher = get_hasher("v2_sha256")
    tpb = 4
    emitter.created(0, window_size=4096, num_blocks_per_cache_level=[1024], tokens_per_block=tpb)
    emitter.created(
        1,
        window_size=8,
        num_blocks_per_cache_level=[256],
        tokens_per_block=tpb,
        attention_kind=AttentionKind.SLIDING_WINDOW,
    )

    blocks = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    hashes = hasher.chain_bytes(blocks)
    for group in (0, 1):
        parent = None
        for tokens, h in zip(blocks, hashes, strict=True):
            emitter.stored(group, parent_hash=parent, block_hash=h, token_ids=tokens)
            parent = h
    # The same prefix again (a second request reusing it): nothing new to announce.
    emitter.stored(0, parent_hash=None, block_hash=hashes[0], token_ids=blocks[0])
    # The sliding window drops its oldest blocks; both removals become one event.
    emitter.removed(1, hashes[0])
    emitter.removed(1, hashes[1])

    batch = emitter.flush()
    assert batch is not None
    for ev in batch.events:
        detail = ""
        if ev.data.type == "stored":
            detail = f"{len(ev.data.blocks)} blocks"
        elif ev.data.type == "removed":
            detail = f"{len(ev.data.block_hashes)} blocks"
        print(f"id={ev.event_id} group={ev.layer_group_id} {ev.data.type:<8} {detail}")
    kinds = [ev.data.type for ev in batch.events]
    assert kinds == ["created", "created", "stored", "stored", "removed"], kinds


if __name__ == "__main__":
    main()

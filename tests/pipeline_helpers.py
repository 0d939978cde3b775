"""Shared helpers of the pipeline/sink tests: batches with known ids, stream checks."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from kvstream.events.model import (
    EventBatch,
    KVCacheEvent,
    Lost,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
)

WINDOW = 128


def source(name: str = "engine-0", rank: int | None = 0, incarnation: int = 0) -> SourceId:
    return SourceId(instance_id=name, attention_dp_rank=rank, incarnation=incarnation)


def make_batch(src: SourceId, first_id: int, n: int, *, stored: bool = False) -> EventBatch:
    """``n`` events with ids ``first_id..first_id+n-1`` (removed events, or stored ones)."""
    events = []
    for i in range(first_id, first_id + n):
        h = i.to_bytes(8, "big")
        data: Removed | Stored
        if stored:
            data = Stored(blocks=(StoredBlock(block_hash=h, token_ids=[i % 1000, 1, 2, 3]),))
        else:
            data = Removed(block_hashes=(h,))
        events.append(
            KVCacheEvent(event_id=i, hash_algo="v1_block_key", window_size=WINDOW, data=data)
        )
    return EventBatch(source=src, ts_ns=first_id, events=tuple(events))


def batches_for(src: SourceId, total: int, per_batch: int, **kw: bool) -> list[EventBatch]:
    return [make_batch(src, i, min(per_batch, total - i), **kw) for i in range(0, total, per_batch)]


def stream_ids(batches: Iterable[EventBatch]) -> dict[SourceId, list[tuple[int, int, bool]]]:
    """Per source, each event's covered id span (first, last, is_marker) in delivery order."""
    out: dict[SourceId, list[tuple[int, int, bool]]] = defaultdict(list)
    for b in batches:
        for ev in b.events:
            if isinstance(ev.data, Lost):
                out[b.source].append((ev.data.first_event_id, ev.event_id, True))
            else:
                out[b.source].append((ev.event_id, ev.event_id, False))
    return out


def check_contiguous(
    spans: list[tuple[int, int, bool]], total: int, *, allow_duplicates: bool = False
) -> tuple[int, int]:
    """Assert ids 0..total-1 are each covered once (an event or a marker range), in order.

    With ``allow_duplicates`` an event/marker may repeat ids already seen (at-least-once).
    Returns (delivered events, ids covered by markers).
    """
    nxt = 0
    delivered = lost = 0
    for span_first, last, marker in spans:
        first = span_first
        if allow_duplicates and first < nxt:
            if last < nxt:
                continue
            first = nxt  # a marker overlapping ids that did arrive (partial delivery)
        assert first == nxt, f"expected id {nxt}, got {first}..{last} (marker={marker})"
        if marker:
            assert last >= first
            lost += last - first + 1
        else:
            delivered += 1
        nxt = last + 1
    assert nxt == total, f"stream ends at {nxt}, expected {total}"
    return delivered, lost


def small_cache_manager(instance: str, rank: int | None, incarnation: int = 7) -> Any:
    """A metadata-only KV-cache manager with a full-attention and a sliding-window group."""
    from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec

    cfg = CacheConfig(
        tokens_per_block=16,
        groups=[
            LayerGroupSpec(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=96),
            LayerGroupSpec(
                num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=64, window_size=128
            ),
        ],
        hash_algo="v2_sha256_64",
        metadata_only=True,
    )
    src = SourceId(instance_id=instance, attention_dp_rank=rank, incarnation=incarnation)
    return KVCacheManager(cfg, source=src)


def small_chats(conversations: int, seed: int) -> Any:
    """The requests of a small multi-turn chat workload (``multi_turn_chats``)."""
    from kvstream.workloads import ChatWorkload, multi_turn_chats

    work = ChatWorkload(
        num_conversations=conversations,
        turns=(2, 4),
        num_system_prompts=2,
        system_prompt_tokens=(64, 200),
        user_tokens=(8, 60),
        output_tokens=(8, 60),
        seed=seed,
    )
    return multi_turn_chats(work)


def cache_batches(
    instance: str,
    rank: int | None,
    *,
    conversations: int = 6,
    seed: int = 0,
    deferred: bool = False,
) -> list[Any]:
    """Run :func:`small_cache_manager` over :func:`small_chats`; the event batches it
    emitted, one per iteration (``deferred``: its ``flush_events_deferred()`` hand-off, the
    DeferredBatch objects an engine submits)."""
    mgr = small_cache_manager(instance, rank)
    flush = mgr.flush_events_deferred if deferred else mgr.flush_events
    out = []
    for req in small_chats(conversations, seed):
        mgr.add_request(req.request_id, req.prompt)
        for i in range(0, len(req.output), 16):
            mgr.append_tokens(req.request_id, req.output[i : i + 16])
            b = flush()
            if b is not None:
                out.append(b)
        mgr.free_request(req.request_id)
        b = flush()
        if b is not None:
            out.append(b)
    return out

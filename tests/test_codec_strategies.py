"""Hypothesis strategies building valid EventBatches for the codec tests (and their own tests).

Other codec test modules import ``batches``/``v1_batches`` from here.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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

I32 = 2**31 - 1
I64 = 2**63 - 1
# (hash_algo, width): known algorithms and an unknown one of each allowed width.
ALGOS = [
    ("v1_block_key", 8),
    ("v2_sha256", 32),
    ("v2_sha256_64", 8),
    ("vllm_sha256_cbor", 32),
    ("blake3", 32),
    ("future_algo_16", 16),
    ("future_algo_8", 8),
]

small_text = st.text(max_size=12)
token_id = st.one_of(
    st.integers(0, 127),
    st.integers(0, 2**16 - 1),
    st.integers(0, 2**17 - 1),
    st.integers(0, 2**32 - 1),
    st.sampled_from([0, 2**16 - 1, 2**16, 2**31, 2**32 - 1]),
)


# Engine extra keys (vLLM ``extra_keys``): scalars and tuples of scalars, integers over the
# whole model range (negative offsets, beyond a signed long), empty strings/bytes/tuples.
extra_atom = st.one_of(
    small_text,
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([-(2**63), -1, 0, 2**63 - 1, 2**63, 2**64 - 1]),
    st.binary(max_size=40),
)
extra_key = st.one_of(extra_atom, st.lists(extra_atom, max_size=3).map(tuple))
extra_keys = st.one_of(st.none(), st.lists(extra_key, max_size=4).map(tuple))


def token_ids(n: int) -> st.SearchStrategy[TokenIds]:
    return st.lists(token_id, min_size=n, max_size=n).map(TokenIds)


@st.composite
def stored(draw: st.DrawFn, width: int, with_extra_keys: bool = True) -> Stored:
    n = draw(st.integers(1, 5))
    size = draw(st.integers(0, 9))
    shape = draw(st.sampled_from(["uniform", "partial_last", "irregular"]))
    if shape == "uniform":
        sizes = [size] * n
    elif shape == "partial_last":
        sizes = [size] * (n - 1) + [draw(st.integers(0, size))]
    else:
        sizes = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    # Each attribute is either uniform across the blocks or drawn per block.
    attrs: dict[str, Any] = {}
    per_block = draw(
        st.sets(
            st.sampled_from(
                [
                    "lora_id",
                    "lora_name",
                    "cache_level",
                    "priority",
                    "cache_salt",
                    "mm_keys",
                    "extra",
                    "extra_keys",
                ]
            )
        )
    )
    values = {
        "lora_id": st.one_of(st.none(), st.integers(0, 2**64 - 1), st.sampled_from([2**63, 0])),
        "lora_name": st.one_of(st.none(), small_text),
        "cache_level": st.integers(0, 3),
        "priority": st.integers(0, 100),
        "cache_salt": st.one_of(st.none(), small_text),
        "mm_keys": st.lists(
            st.builds(
                MmKey,
                hash=st.binary(min_size=32, max_size=32),
                start_offset=st.integers(0, I32),
                uuid=st.one_of(st.none(), small_text),
            ),
            max_size=2,
        ).map(tuple),
        "extra_keys": extra_keys if with_extra_keys else st.none(),
    }
    uniform = {k: draw(v) for k, v in values.items() if k not in per_block}
    blocks = []
    for size_i in sizes:
        attrs = dict(uniform)
        for k in per_block - {"extra"}:
            attrs[k] = draw(values[k])
        tokens = draw(token_ids(size_i))
        extra = draw(st.one_of(st.none(), token_ids(size_i))) if "extra" in per_block else None
        blocks.append(
            StoredBlock(
                block_hash=draw(st.binary(min_size=width, max_size=width)),
                token_ids=tokens,
                token_extra_ids=extra,
                **attrs,
            )
        )
    parent = draw(st.one_of(st.none(), st.binary(min_size=width, max_size=width)))
    return Stored(parent_hash=parent, blocks=tuple(blocks))


@st.composite
def event_data(
    draw: st.DrawFn, width: int, kinds: tuple[str, ...], with_extra_keys: bool = True
) -> Any:
    kind = draw(st.sampled_from(kinds))
    hashes = st.binary(min_size=width, max_size=width)
    diff = st.builds(EventDiff, old_value=st.integers(0, I32), new_value=st.integers(0, I32))
    prio = st.builds(EventDiff, old_value=st.integers(0, 100), new_value=st.integers(0, 100))
    if kind == "stored":
        return draw(stored(width, with_extra_keys))
    if kind == "removed":
        return Removed(
            block_hashes=tuple(draw(st.lists(hashes, min_size=1, max_size=4))),
            cache_level=draw(st.one_of(st.none(), st.integers(0, I32))),
        )
    if kind == "updated":
        level = draw(st.one_of(st.none(), diff))
        priority = draw(st.one_of(st.none(), prio)) if level is not None else draw(prio)
        return Updated(block_hash=draw(hashes), cache_level=level, priority=priority)
    if kind == "created":
        return Created(
            num_blocks_per_cache_level=tuple(
                draw(st.lists(st.integers(0, I64), min_size=1, max_size=3))
            ),
            tokens_per_block=draw(st.integers(1, I32)),
            attention_kind=draw(st.sampled_from(list(AttentionKind))),
        )
    if kind == "cleared":
        return Cleared()
    return Lost(
        first_event_id=draw(st.integers(0, I64)),
        count=draw(st.integers(1, I64)),
        reason=draw(small_text),
    )


ALL_KINDS = ("created", "stored", "removed", "updated", "cleared", "lost")
V1_KINDS = ("created", "stored", "removed", "updated")


@st.composite
def events(draw: st.DrawFn, kinds: tuple[str, ...] = ALL_KINDS, v1: bool = False) -> KVCacheEvent:
    algo, width = ALGOS[0] if v1 else draw(st.sampled_from(ALGOS))
    return KVCacheEvent(
        event_id=draw(st.integers(0, I64)),
        hash_algo=algo,
        layer_group_id=0 if v1 else draw(st.integers(0, I32)),
        window_size=draw(st.integers(1, I64)),
        data=draw(event_data(width, kinds, with_extra_keys=not v1)),
    )


@st.composite
def batches(draw: st.DrawFn, max_events: int = 6) -> EventBatch:
    """Any valid batch: every kind, every hash width, every block layout and attribute mix."""
    return EventBatch(
        source=SourceId(
            instance_id=draw(st.text(min_size=1, max_size=20)),
            attention_dp_rank=draw(st.one_of(st.none(), st.integers(0, I32))),
            incarnation=draw(st.integers(0, I64)),
        ),
        ts_ns=draw(st.integers(0, I64)),
        events=tuple(draw(st.lists(events(), max_size=max_events))),
    )


@st.composite
def v1_batches(draw: st.DrawFn, max_events: int = 6) -> EventBatch:
    """Batches whose events schema v1 can carry (no cleared/lost, v1_block_key hashes, no
    engine extra keys)."""
    return EventBatch(
        source=SourceId(
            instance_id=draw(st.text(min_size=1, max_size=20)),
            attention_dp_rank=draw(st.one_of(st.none(), st.integers(0, I32))),
        ),
        ts_ns=draw(st.integers(0, I64)),
        events=tuple(draw(st.lists(events(V1_KINDS, v1=True), max_size=max_events))),
    )


# Generation slows down on a loaded machine; the health check is not what these tests test.
@settings(max_examples=50, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_strategy_builds_valid_batches(batch: EventBatch) -> None:
    assert EventBatch.model_validate(batch.model_dump()) == batch


@settings(max_examples=30, suppress_health_check=[HealthCheck.too_slow])
@given(v1_batches())
def test_v1_strategy_stays_inside_v1(batch: EventBatch) -> None:
    assert all(ev.hash_algo == "v1_block_key" and ev.kind.value in V1_KINDS for ev in batch.events)
    assert all(
        b.extra_keys is None
        for ev in batch.events
        if isinstance(ev.data, Stored)
        for b in ev.data.blocks
    )

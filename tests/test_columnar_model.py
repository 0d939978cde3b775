"""``ColumnBatch.from_batch`` (columns of a model batch, what ``PrefixIndex.apply`` builds for
every model batch it gets) against a reference written the plain way: the constructor, then
one comprehension per field. It sets the slots itself, so no slot may be left unset."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from test_codec_strategies import batches

from kvstream.events.columns import (
    CLEARED,
    CREATED,
    LOST,
    REMOVED,
    STORED,
    UPDATED,
    ColumnBatch,
)
from kvstream.events.model import Created, EventBatch, Lost, Removed, Stored, Updated


def reference(batch: EventBatch) -> ColumnBatch:
    src = batch.source
    out = ColumnBatch(
        src.instance_id,
        attention_dp_rank=src.attention_dp_rank,
        incarnation=src.incarnation,
        ts_ns=batch.ts_ns,
        schema_version=batch.schema_version,
        tokens=b"",
        batch=batch,
    )
    out.has_blocks = True
    for ev in batch.events:
        d = ev.data
        out.event_ids.append(ev.event_id)
        out.hash_algos.append(ev.hash_algo)
        out.group_ids.append(ev.layer_group_id)
        out.window_sizes.append(ev.window_size)
        payload: Any = None
        code = CLEARED
        if isinstance(d, Stored):
            levels = [b.cache_level for b in d.blocks]
            payload = (
                d.parent_hash,
                [b.block_hash for b in d.blocks],
                levels[0] if len(set(levels)) == 1 else levels,
                len(d.blocks[0].token_ids),
                d.blocks,
            )
            code = STORED
        elif isinstance(d, Removed):
            payload, code = (list(d.block_hashes), d.cache_level), REMOVED
        elif isinstance(d, Updated):
            lv, pr = d.cache_level, d.priority
            payload = (
                d.block_hash,
                None if lv is None else (lv.old_value, lv.new_value),
                None if pr is None else (pr.old_value, pr.new_value),
            )
            code = UPDATED
        elif isinstance(d, Created):
            payload = (d.num_blocks_per_cache_level, d.tokens_per_block, d.attention_kind.value)
            code = CREATED
        elif isinstance(d, Lost):
            payload, code = (d.first_event_id, d.count, d.reason), LOST
        out.kinds.append(code)
        out.payloads.append(payload)
    return out


def slots(c: ColumnBatch) -> dict[str, Any]:
    names = [n for k in type(c).__mro__ for n in getattr(k, "__slots__", ())]
    return {n: getattr(c, n) for n in names}  # AttributeError for a slot left unset


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches())
def test_from_batch_equals_the_constructor_path(batch: EventBatch) -> None:
    got = ColumnBatch.from_batch(batch)
    want = reference(batch)
    assert slots(got) == slots(want)
    assert got.to_batch() is batch
    assert got.tokens == b""
    assert len(got) == len(batch.events)

"""An emitter's buffered records -> :class:`~kvstream.events.model.EventBatch`:
:func:`emitted_batch`, which builds without re-validating what the emitter already checked.
Pipelines whose sinks take columns never call it (the batch goes out as columns); it serves
the sinks and readers that ask for models."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from kvstream._types import TokenIds, TokenIdsView
from kvstream.events.deferred import BlockRun, model_input
from kvstream.events.emitter_checks import _I64_MAX
from kvstream.events.model import EventBatch, KVCacheEvent, Removed, SourceId, Stored
from kvstream.events.trusted import (
    token_blocks,
    trusted_builder,
    trusted_stored_blocks,
)

__all__ = ["emitted_batch"]


_BUILD_EVENT: Final = trusted_builder(KVCacheEvent)
_BUILD_STORED: Final = trusted_builder(Stored)
_BUILD_REMOVED: Final = trusted_builder(Removed)
_BUILD_BATCH: Final = trusted_builder(EventBatch)
_views: Final = TokenIdsView.of_run


def emitted_batch(source: SourceId, ts_ns: int, records: Iterable[dict[str, Any]]) -> EventBatch:
    """The :class:`EventBatch` of an emitter's buffered records: equal to
    ``EventBatch(source=source, ts_ns=ts_ns, events=model_input(records))`` (same fields and
    ``model_fields_set``; a record that would fail validation raises EventValidationError).

    The emitter validated every value it recorded (hash widths, ids, groups, tokens), so the
    ``stored`` events of plain blocks and the ``removed`` events, nearly all of a cache's
    traffic, are built without re-validating (:mod:`kvstream.events.trusted`); any other
    record (blocks with attributes, created/updated/cleared/lost) is validated as before.
    """
    if type(ts_ns) is not int or not 0 <= ts_ns <= _I64_MAX:
        return EventBatch(source=source, ts_ns=ts_ns, events=model_input(records))
    events = _events(records)
    return _BUILD_BATCH({"source": source, "ts_ns": ts_ns, "events": events})


def _validated_event(rec: dict[str, Any]) -> KVCacheEvent:
    return KVCacheEvent(**model_input((rec,))[0])


def _py_events(records: Iterable[dict[str, Any]]) -> tuple[KVCacheEvent, ...]:
    events: list[KVCacheEvent] = []
    append = events.append
    for rec in records:
        data = rec["data"]
        kind = data["type"]
        if kind == "stored":
            run = data["blocks"]
            if type(run) is BlockRun and run.hashes and not run.attrs:
                blocks = trusted_stored_blocks(tuple(run.hashes), _run_tokens(run))
                built = _BUILD_STORED(
                    {"type": "stored", "parent_hash": data["parent_hash"], "blocks": blocks}
                )
                append(_BUILD_EVENT({**rec, "data": built}))
                continue
        elif kind == "removed" and data["block_hashes"]:
            gone = _BUILD_REMOVED(
                {
                    "type": "removed",
                    "block_hashes": tuple(data["block_hashes"]),
                    "cache_level": data["cache_level"],
                }
            )
            append(_BUILD_EVENT({**rec, "data": gone}))
            continue
        append(_validated_event(rec))
    return tuple(events)


_events: Final = _py_events


def _run_tokens(run: BlockRun) -> tuple[TokenIds, ...]:
    # run.block_tokens() as a tuple; a packed chain of k > 1 blocks as views of its bytes
    out: list[TokenIds] = []
    for t in run.tokens:
        if isinstance(t, tuple):
            packed, k = t
            out += token_blocks(packed._raw, len(packed._raw)) if k == 1 else _views(packed._raw, k)
        else:
            out.append(t)
    return tuple(out)

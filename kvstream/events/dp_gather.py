"""Attention-data-parallel gather: rank 0 collects every rank's batches (DESIGN §2.2).

Under attention DP each rank runs its own :class:`~kvstream.events.emitter.EventEmitter`
(``SourceId.attention_dp_rank = r``) with its own event-id counter. Rank 0 concatenates the
ranks' output in rank order; ids stay per-rank, so a consumer checks contiguity per
(instance_id, attention_dp_rank, incarnation).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvstream.errors import EmitterError
from kvstream.events.model import EventBatch, KVCacheEvent

__all__ = ["gather_attention_dp"]


def gather_attention_dp(batches: Iterable[EventBatch]) -> list[EventBatch]:
    """Concatenate the ranks' batches in rank order, one batch per rank.

    Batches of one rank are merged in input order into a single batch (its ``ts_ns`` is the
    latest of theirs); a rank with exactly one batch is passed through unchanged. Every
    event keeps its payload and its per-rank ``event_id``; the output lists ranks in ascending
    order (stable), so per-rank order is preserved.

    Raises :class:`EmitterError` when the batches disagree on ``instance_id``,
    ``incarnation`` or ``schema_version``, when some carry a rank and others do not, or when
    a rank's merged event ids do not strictly increase (the same batch passed twice, batches
    of one rank out of order, or two producers claiming the same rank).
    """
    per_rank: dict[int | None, list[EventBatch]] = {}
    first: EventBatch | None = None
    for batch in batches:
        if not isinstance(batch, EventBatch):
            raise EmitterError(f"gather_attention_dp takes EventBatch, got {type(batch).__name__}")
        src = batch.source
        if first is None:
            first = batch
        else:
            ref = first.source
            if src.instance_id != ref.instance_id:
                raise EmitterError(
                    f"cannot gather batches of different instances: "
                    f"{ref.instance_id!r} and {src.instance_id!r}"
                )
            if src.incarnation != ref.incarnation:
                raise EmitterError(
                    f"cannot gather batches of different incarnations of {src.instance_id!r}: "
                    f"{ref.incarnation} and {src.incarnation}"
                )
            if batch.schema_version != first.schema_version:
                raise EmitterError(
                    f"cannot gather batches of schema versions {first.schema_version} "
                    f"and {batch.schema_version}"
                )
            if (src.attention_dp_rank is None) != (ref.attention_dp_rank is None):
                raise EmitterError("cannot gather batches with and without attention_dp_rank")
        per_rank.setdefault(src.attention_dp_rank, []).append(batch)

    out: list[EventBatch] = []
    for rank in sorted(per_rank, key=lambda r: -1 if r is None else r):
        group = per_rank[rank]
        last_id = -1
        for batch in group:
            for ev in batch.events:
                if ev.event_id <= last_id:
                    raise EmitterError(
                        f"rank {rank}: event id {ev.event_id} follows {last_id}; the rank "
                        "repeats (a batch given twice, out of order, or two producers)"
                    )
                last_id = ev.event_id
        if len(group) == 1:
            out.append(group[0])
            continue
        events: list[KVCacheEvent] = []
        for batch in group:
            events.extend(batch.events)
        out.append(
            EventBatch(
                source=group[0].source,
                ts_ns=max(b.ts_ns for b in group),
                schema_version=group[0].schema_version,
                events=tuple(events),
            )
        )
    return out

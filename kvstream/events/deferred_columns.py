"""An emitter's deferred records -> publisher columns, without building a model per block.

:func:`deferred_columns` turns the raw records of a
:class:`~kvstream.events.deferred.DeferredBatch` into the :class:`~kvstream.events.columns.
ColumnBatch` that :func:`~kvstream.events.columns.publish_columns` makes of the materialised
batch: every column (ids, kinds, groups, windows, payloads, :attr:`~kvstream.events.columns.
ColumnBatch.tokens`, :attr:`~kvstream.events.columns.ColumnBatch.stored_extra`) equal, so a
sink that encodes columns (Kafka, the memory log) and the prefix index take the batch without
its models. The models stay the public API: the columns' :meth:`~kvstream.events.columns.
ColumnBatch.to_batch` is the deferred batch's :meth:`~kvstream.events.deferred.DeferredBatch.
materialize` (built on first call, the same object for every caller).

The emitter's traffic is nearly all ``stored`` events of plain blocks (no per-block
attributes) and non-empty ``removed`` events; those are read straight from the records (a
chain of blocks recorded as one packed TokenIds contributes its bytes once). Any other record
(created, updated, cleared, lost, blocks with attributes, anything unusual) is validated into
its event model, as materialising does, and its columns taken from that model with
``publish_columns`` itself, so both paths agree by construction and a record the model refuses
raises the same EventValidationError.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from kvstream._native import load as load_native
from kvstream.events.columns import REMOVED, STORED, ColumnBatch, StoredExtra, publish_columns
from kvstream.events.deferred import BlockRun, model_input
from kvstream.events.emitter_checks import _I64_MAX
from kvstream.events.model import CURRENT_SCHEMA_VERSION, EventBatch, KVCacheEvent, SourceId

__all__ = ["deferred_columns"]

_DEFAULT_ALGO: Final = KVCacheEvent.model_fields["hash_algo"].default
_DEFAULT_GROUP: Final = KVCacheEvent.model_fields["layer_group_id"].default


def deferred_columns(
    source: SourceId,
    ts_ns: int,
    records: Sequence[dict[str, Any]],
    build: Callable[[], EventBatch],
) -> ColumnBatch:
    """The publisher columns of an emitter's records (see the module doc): equal, column by
    column, to ``publish_columns(emitted_batch(source, ts_ns, records))``; ``build`` makes
    that model on demand (the columns' ``to_batch``). Raises what materialising raises for a
    record (or ``ts_ns``) the model refuses."""
    if type(ts_ns) is not int or not 0 <= ts_ns <= _I64_MAX:
        return publish_columns(build())  # the model's own error (or its exact columns)
    out = ColumnBatch(
        source.instance_id,
        attention_dp_rank=source.attention_dp_rank,
        incarnation=source.incarnation,
        ts_ns=ts_ns,
        schema_version=CURRENT_SCHEMA_VERSION,
        tokens=b"",
        build=build,
    )
    raws: list[bytes] = []
    extra: list[StoredExtra] = []
    out.stored_extra = extra
    event_ids, hash_algos, group_ids = out.event_ids, out.hash_algos, out.group_ids
    window_sizes, kinds, payloads = out.window_sizes, out.kinds, out.payloads
    native = _native_rows()
    if native is None:
        _rows(out, raws, source, records)
    else:
        if type(records) is not list:  # the emitter's deque: indexing it is not O(1)
            records = list(records)
        columns = (event_ids, kinds, hash_algos, group_ids, window_sizes, payloads, extra)
        i, n = 0, len(records)
        while i < n:  # C appends what it reads straight; the record it leaves, Python
            i = native(records, i, columns, raws, BlockRun, _DEFAULT_ALGO, _DEFAULT_GROUP)
            if i < n:
                _rows(out, raws, source, records[i : i + 1])
                i += 1
    out.tokens = b"".join(raws)
    return out


def _rows(
    out: ColumnBatch, raws: list[bytes], source: SourceId, records: Sequence[dict[str, Any]]
) -> None:
    """The rows of ``records`` appended to ``out``'s columns and their token bytes to
    ``raws``: the Python loop (the C ``deferred_rows`` does the same for the records it reads
    straight)."""
    extra = out.stored_extra
    assert extra is not None
    event_ids, hash_algos, group_ids = out.event_ids, out.hash_algos, out.group_ids
    window_sizes, kinds, payloads = out.window_sizes, out.kinds, out.payloads
    for rec in records:
        data = rec["data"]
        kind = data["type"]
        payload: Any
        if kind == "stored":
            run = data["blocks"]
            if type(run) is not BlockRun or not run.hashes or run.attrs:
                _append_validated(out, raws, source, rec)
                continue
            sizes: list[int] = []
            for t in run.tokens:
                if isinstance(t, tuple):
                    packed, k = t
                    raw = packed.raw
                    raws.append(raw)
                    sizes += [len(raw) // k >> 2] * k
                else:
                    raw = t.raw
                    raws.append(raw)
                    sizes.append(len(raw) >> 2)
            extra.append((sizes, None))
            payload = (data["parent_hash"], list(run.hashes), 0, sizes[0])
            code = STORED
        elif kind == "removed" and data["block_hashes"]:
            payload = (list(data["block_hashes"]), data["cache_level"])
            code = REMOVED
        else:
            _append_validated(out, raws, source, rec)
            continue
        event_ids.append(rec["event_id"])
        hash_algos.append(rec.get("hash_algo", _DEFAULT_ALGO))
        group_ids.append(rec.get("layer_group_id", _DEFAULT_GROUP))
        window_sizes.append(rec["window_size"])
        kinds.append(code)
        payloads.append(payload)


def _native_rows() -> Any:
    """The C ``deferred_rows`` (in the codec extension), or None (pure Python)."""
    global _NATIVE_ROWS  # noqa: PLW0603  (set once; tests patch it to force Python)
    if _NATIVE_ROWS is _UNSET:
        mod: Any = load_native("kvstream.codec._tokens_native")
        _NATIVE_ROWS = getattr(mod, "deferred_rows", None)
    return _NATIVE_ROWS


_UNSET: Final[Any] = object()
#: deferred_columns' loop in C for the records it reads straight (None: Python; unset until
#: :func:`_native_rows` first runs: the extension lives in the codec package)
_NATIVE_ROWS: Any = _UNSET


def _append_validated(
    out: ColumnBatch, raws: list[bytes], source: SourceId, rec: dict[str, Any]
) -> None:
    # the record's event validated as materialising validates it; its columns are what
    # publish_columns makes of it, appended to out's (its tokens to raws)
    event = KVCacheEvent(**model_input((rec,))[0])
    one = publish_columns(EventBatch(source=source, ts_ns=out.ts_ns, events=(event,)))
    assert one.stored_extra is not None
    assert out.stored_extra is not None
    out.stored_extra += one.stored_extra
    raws.append(one.tokens)
    out.event_ids += one.event_ids
    out.hash_algos += one.hash_algos
    out.group_ids += one.group_ids
    out.window_sizes += one.window_sizes
    out.kinds += one.kinds
    out.payloads += one.payloads

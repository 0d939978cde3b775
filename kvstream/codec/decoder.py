"""Schemaless Avro body -> EventBatch, for any writer schema the current reader can resolve.

fastavro reads the body with the writer's schema, resolving it into the current (reader)
schema; :func:`kvstream.codec.records.record_to_batch` then validates and builds the model.
Whatever fastavro raises on bad bytes (EOFError, ValueError, IndexError, UnicodeDecodeError,
MemoryError, its SchemaResolutionError, ...) surfaces as DecodeError with the cause chained.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import fastavro

from kvstream.codec.records import SkippedEvent, record_to_batch
from kvstream.codec.schemas import SchemaInfo
from kvstream.errors import DecodeError
from kvstream.events.model import EventBatch

__all__ = ["DecodeResult", "decode_body", "read_record"]


@dataclass(frozen=True)
class DecodeResult:
    """A decoded batch with what the decoder had to leave out.

    ``writer_version`` is the schema version the data was written with; ``skipped`` lists the
    events this reader could not represent (kinds added by a later version, ``created`` events
    of v1 data without ``tokens_per_block``), each with its id and reason.
    """

    batch: EventBatch
    writer_version: int
    skipped: tuple[SkippedEvent, ...] = ()

    @property
    def skipped_count(self) -> int:
        """How many events were skipped."""
        return len(self.skipped)


def read_record(body: bytes, writer: SchemaInfo, reader: SchemaInfo) -> dict[str, Any]:
    """One record of ``writer``'s schema resolved into ``reader``'s, consuming all of ``body``.

    Raises DecodeError when the bytes are not exactly one such record.
    """
    fo = io.BytesIO(body)
    try:
        record = fastavro.schemaless_reader(
            fo, writer.parsed, None if writer is reader else reader.parsed
        )
    except Exception as exc:  # fastavro raises many unrelated types on bad input
        raise DecodeError(
            f"body is not a valid schema v{writer.version} record "
            f"({type(exc).__name__}: {exc or 'unexpected end of data'})"
        ) from exc
    extra = len(body) - fo.tell()
    if extra:
        raise DecodeError(f"{extra} bytes left over after the schema v{writer.version} record")
    if not isinstance(record, dict):  # pragma: no cover - the top level is a record schema
        raise DecodeError("body did not decode to a record")
    return record


def decode_body(body: bytes, writer: SchemaInfo, reader: SchemaInfo) -> DecodeResult:
    """Decode a schemaless body written with ``writer`` into the model via ``reader``."""
    record = read_record(body, writer, reader)
    batch, skipped = record_to_batch(record, writer.version)
    return DecodeResult(batch, writer.version, skipped)

"""Type stub of the optional C extension ``kvstream.codec._columns_native``
(``_columns_native.c``): EventBatch records of schema v3/v4 straight into the columns of
:class:`kvstream.codec.columnar.ColumnBatch`; ``columnar.py`` (fastavro + ``record_columns``) is
the reference and the fallback for every record this decoder declines."""

from typing import Any

def configure(
    widths: dict[str, int],
    unknown_widths: tuple[int, ...],
    priority_max: int,
    attention: tuple[Any, Any, Any],
) -> None:
    """The model's rules: hash width per known algorithm, widths an unknown one may have, the
    largest priority, the AttentionKind values of the symbols (UNKNOWN, FULL, SLIDING)."""

def decode(buf: bytes | memoryview, offset: int, version: int) -> tuple[Any, ...] | None:
    """The record of writer ``version`` (3 or 4) at ``buf[offset]``: ``(end, instance_id,
    attention_dp_rank, incarnation, ts_ns, tokens, event_ids, kinds, hash_algos, group_ids,
    window_sizes, payloads, skipped)``; ``tokens`` is the ids' bytes or ``(encoding code,
    count, zstd data)``. None: decode it with the reference."""

def packed_ids(encoding: int, data: bytes | memoryview, count: int) -> bytes | None:
    """Uncompressed packed ids (2 BIT_PLANES, 3 VARINT, 4 DELTA_VARINT) as little-endian
    uint32 bytes; None unless ``data`` holds exactly ``count`` valid ids."""

def model_columns(
    events: tuple[Any, ...],
    stored_type: type[Any],
    removed_type: type[Any],
    stored_code: int,
    removed_code: int,
) -> tuple[list[Any], list[Any], list[Any], list[Any], list[Any], list[Any]] | None:
    """:meth:`ColumnBatch.from_batch`'s ``(event_ids, hash_algos, group_ids, window_sizes,
    kinds, payloads)`` of validated events whose data are all exactly ``stored_type`` or
    ``removed_type``; None for any other batch (the Python loop builds those)."""

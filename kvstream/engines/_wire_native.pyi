"""Type stub of the optional C extension ``kvstream.engines._wire_native``
(``_wire_native.c``).

msgpack arrays of the vLLM-family wire format read without a Python int per element;
:mod:`kvstream.engines.vllm` holds the pure-Python equivalents. ``buf`` holds exactly one
msgpack array; anything else raises ValueError.
"""

from typing import Any

from typing_extensions import Buffer

def u32_array(buf: Buffer) -> bytes:
    """A msgpack array of ints in 0..2**32-1 as packed little-endian uint32."""

def be64_array(buf: Buffer) -> tuple[bytes, ...]:
    """A msgpack array of ints in 0..2**64-1, each as 8 bytes big-endian."""

def removed_run(
    events: list[Any], start: int, removed_type: type, levels: dict[str, int]
) -> tuple[int, list[bytes], int, int | None] | None:
    """A run of removal structs of one group and level: (end, hashes, group, level)."""

def peek_rank(payload: Buffer) -> int | None:
    """A batch's ``data_parallel_rank`` (None: it has none), read without decoding its
    events; ValueError when it is not a ``[ts, events, rank?]`` array with such a rank."""

def batch_columns(
    payload: Buffer,
    next_id: int,
    windows: dict[int, int],
    levels: dict[str, int],
    external: int,
    unbounded: int,
    into: list[Any] | None = None,
    rank: int | None = ...,
) -> (
    tuple[float, int | None, int]
    | tuple[
        float,
        int | None,
        list[int],
        list[int],
        list[int],
        list[int],
        list[Any],
        list[Any],
        bytes,
        int,
        list[tuple[int, list[int]]],
    ]
    | None
):
    """One payload's columns as ``EngineStream._fast_columns`` builds them (``windows``
    updated in place), or None for a payload outside the one-call subset. With ``into``
    (``[ids, kinds, groups, windows, payloads, extra, layout]`` lists and a ``bytearray`` of
    tokens): the columns are appended to those and ``(ts, rank, next_id)`` returned; on None
    or an error they and ``windows`` are left as they were. ``rank``: the payload must
    name that ``data_parallel_rank`` (None: none), else None."""

"""The Mooncake FAST'25 traces (DESIGN §9) turned into token-level requests.

A trace row gives ``input_length``, ``output_length`` and ``hash_ids``: prefix-chained ids of
512-token blocks (equal ids mean equal content *and* equal prefix). Each id stands for a
fixed pseudo-random list of 512 tokens (a function of the id and a seed), and a row's prompt
is the concatenation of its ids' lists cut to exactly ``input_length`` tokens (the last block
is usually partial). Hashing those tokens with any chained block hash reproduces the trace's
prefix structure, so a cache replay hits exactly where the trace says it can.

Files are found under :func:`data_dir`: ``$KVSTREAM_DATA_DIR`` or ``../shared/data`` next to
the repository, in ``mooncake/<name>_trace.jsonl``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Final

from kvstream._types import TokenIds
from kvstream.workloads.base import (
    DataNotFoundError,
    TraceFormatError,
    WorkloadRequest,
    pseudo_tokens,
)

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "MooncakeTokens",
    "TraceRow",
    "data_dir",
    "load_trace",
    "mooncake_requests",
    "trace_path",
]

#: Tokens per hash id in the Mooncake traces.
MOONCAKE_BLOCK_TOKENS: Final = 512
DATA_DIR_ENV: Final = "KVSTREAM_DATA_DIR"


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One trace request (``index`` is its 0-based line number)."""

    index: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def data_dir() -> Path:
    """The shared data directory: ``$KVSTREAM_DATA_DIR``, else ``<repo>/../shared/data``.

    Raises DataNotFoundError (saying where it looked) when the directory does not exist.
    """
    env = os.environ.get(DATA_DIR_ENV)
    path = Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "data"
    if not path.is_dir():
        how = f"${DATA_DIR_ENV}={env}" if env else f"the default {path}"
        raise DataNotFoundError(
            f"workload data directory not found ({how}); set {DATA_DIR_ENV} to the directory "
            "holding mooncake/*.jsonl (see shared/data/README.md)"
        )
    return path


def trace_path(name: str = "conversation") -> Path:
    """Path of ``mooncake/<name>_trace.jsonl`` under :func:`data_dir` (DataNotFoundError
    when missing)."""
    path = data_dir() / "mooncake" / f"{name}_trace.jsonl"
    if not path.is_file():
        raise DataNotFoundError(f"Mooncake trace {name!r} not found at {path}")
    return path


def _int_field(row: dict[str, object], name: str, where: str, minimum: int) -> int:
    v = row.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TraceFormatError(f"{where}: {name} must be an int >= {minimum}, got {v!r}")
    return v


def load_trace(source: str | Path = "conversation", *, limit: int | None = None) -> list[TraceRow]:
    """Rows of a trace: a name (``"conversation"``, ``"synthetic"``) or a file path.

    Validates every row (``len(hash_ids) == ceil(input_length / 512)``); TraceFormatError
    names the line and field, DataNotFoundError a missing file. ``limit`` keeps the first rows.
    """
    if isinstance(source, Path) or source.endswith(".jsonl") or os.sep in source:
        path = Path(source)
    else:
        path = trace_path(source)
    if not path.is_file():
        raise DataNotFoundError(f"trace file not found: {path}")
    rows: list[TraceRow] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{where}: not JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{where}: a row must be a JSON object")
            n_in = _int_field(obj, "input_length", where, 1)
            ids = obj.get("hash_ids")
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
            ):
                raise TraceFormatError(f"{where}: hash_ids must be a list of ints >= 0")
            if len(ids) != -(-n_in // MOONCAKE_BLOCK_TOKENS):
                raise TraceFormatError(
                    f"{where}: {len(ids)} hash_ids for input_length {n_in} (expected "
                    f"ceil({n_in}/{MOONCAKE_BLOCK_TOKENS}))"
                )
            rows.append(
                TraceRow(
                    index=len(rows),
                    timestamp_ms=_int_field(obj, "timestamp", where, 0),
                    input_length=n_in,
                    output_length=_int_field(obj, "output_length", where, 0),
                    hash_ids=tuple(ids),
                )
            )
    return rows


class MooncakeTokens:
    """Maps hash ids and rows to tokens, deterministically for a given ``seed``.

    ``block(hash_id)`` is the id's fixed list of 512 tokens; ``prompt(row)`` exactly
    ``input_length`` tokens; ``output(row)`` ``output_length`` tokens keyed by the row index.
    """

    def __init__(self, *, seed: int = 0, vocab_size: int = 32000, cache_size: int = 8192) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.seed = seed
        self.vocab_size = vocab_size
        self._block = lru_cache(maxsize=cache_size)(self._make_block)

    def _make_block(self, hash_id: int) -> TokenIds:
        key = b"mooncake\x00%d\x00%d" % (self.seed, hash_id)
        return pseudo_tokens(key, MOONCAKE_BLOCK_TOKENS, self.vocab_size)

    def block(self, hash_id: int) -> TokenIds:
        """The 512 tokens of ``hash_id``."""
        return self._block(hash_id)

    def prompt(self, row: TraceRow) -> TokenIds:
        """The row's prompt: its ids' tokens, concatenated, cut to ``input_length``."""
        raw = b"".join(self._block(h).raw for h in row.hash_ids)
        return TokenIds.from_bytes(raw[: 4 * row.input_length])

    def output(self, row: TraceRow) -> TokenIds:
        """``output_length`` generated tokens for the row."""
        key = b"mooncake-out\x00%d\x00%d" % (self.seed, row.index)
        return pseudo_tokens(key, row.output_length, self.vocab_size)


def mooncake_requests(
    rows: Iterable[TraceRow], *, seed: int = 0, vocab_size: int = 32000
) -> Iterator[WorkloadRequest]:
    """The rows as requests (lazily: prompts are built one at a time), ids ``m<index>``."""
    tokens = MooncakeTokens(seed=seed, vocab_size=vocab_size)
    for row in rows:
        yield WorkloadRequest(
            request_id=f"m{row.index}",
            arrival_ms=float(row.timestamp_ms),
            prompt=tokens.prompt(row),
            output=tokens.output(row),
        )

"""Request traces: where the shipped ones live, and the file formats a replay reads.

Three JSON Lines formats, one request per line (detected per line, so a file may mix them):

- **hash ids** (Mooncake FAST'25, and the ``hash_ids`` + ``input_length`` traces others
  publish): ``{"timestamp": 0, "input_length": 6758, "output_length": 500,
  "hash_ids": [0, 1, ...]}``. Each id stands for one block of ``block_tokens`` tokens,
  prefix-chained (equal ids mean equal content *and* prefix), ``len(hash_ids) ==
  ceil(input_length / block_tokens)``. The block size is 512 for Mooncake; for other traces
  it is inferred from the lengths (every row must agree) unless given.
- **token ids**: ``{"timestamp": 0, "tokens": [1, 2, ...]}``; ``input_ids`` and
  ``prompt_token_ids`` are accepted for ``tokens``. ``output_length`` (or the length of
  ``output_ids``/``output_tokens``) is optional (0 when absent).

``timestamp`` is the arrival time in ``time_unit`` (``"ms"`` by default, ``"s"`` for traces
stamped in seconds); ``timestamp_ms``/``timestamp_s`` name their unit themselves. Rows are
returned in arrival order (a stable sort). Every malformed row raises TraceFormatError naming
the file, the line and the field.

Shipped traces (:data:`TRACE_NAMES`): the Mooncake FAST'25 ``conversation`` and
``synthetic`` traces, gzip-compressed inside the package (``kvstream/workloads/data``,
Apache-2.0, see ``data/NOTICE``), so they work from any directory after ``pip install``.
``$KVSTREAM_DATA_DIR`` (a directory holding ``mooncake/<name>_trace.jsonl``) overrides them.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

from kvstream._types import TOKEN_ID_MAX, TokenIds
from kvstream.workloads.base import DataNotFoundError, TraceFormatError

__all__ = [
    "DATA_DIR_ENV",
    "MOONCAKE_BLOCK_TOKENS",
    "TRACE_NAMES",
    "TraceRow",
    "data_dir",
    "infer_block_tokens",
    "load_trace",
    "packaged_data_dir",
    "resolve_trace",
    "trace_path",
]

#: Tokens per hash id in the Mooncake traces.
MOONCAKE_BLOCK_TOKENS: Final = 512
#: Environment variable naming a directory with ``mooncake/<name>_trace.jsonl`` files.
DATA_DIR_ENV: Final = "KVSTREAM_DATA_DIR"
#: The traces shipped in the package.
TRACE_NAMES: Final = ("conversation", "synthetic")
_TOKEN_FIELDS: Final = ("tokens", "input_ids", "prompt_token_ids")
_OUTPUT_FIELDS: Final = ("output_ids", "output_tokens")
_TIME_UNITS: Final = {"ms": 1.0, "s": 1000.0}


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One trace request.

    ``index``: its position in arrival order (0-based); ``timestamp_ms``: arrival time;
    ``hash_ids``: its blocks' prefix-chained ids (empty for a token-id row); ``tokens``: the
    prompt itself for a token-id row (None for a hash-id row); ``block_tokens``: tokens per
    hash id; ``line``: the line of the file it came from (0 when not read from a file).
    """

    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    tokens: TokenIds | None = None
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    line: int = field(default=0, compare=False)


def packaged_data_dir() -> Path:
    """The directory of the traces shipped inside the package."""
    return Path(__file__).resolve().parent / "data"


def data_dir() -> Path:
    """Where named traces are looked up: ``$KVSTREAM_DATA_DIR`` when set (DataNotFoundError
    when that directory does not exist), else :func:`packaged_data_dir`."""
    env = os.environ.get(DATA_DIR_ENV)
    if not env:
        return packaged_data_dir()
    path = Path(env)
    if not path.is_dir():
        raise DataNotFoundError(
            f"${DATA_DIR_ENV}={env} is not a directory; unset it to use the traces shipped "
            "with kvstream, or point it at a directory holding mooncake/<name>_trace.jsonl"
        )
    return path


def trace_path(name: str = "conversation") -> Path:
    """The file of the named trace (``conversation``, ``synthetic``; a ``mooncake-`` prefix
    is accepted): under ``$KVSTREAM_DATA_DIR/mooncake`` when that is set, else the copy shipped
    in the package. DataNotFoundError names what exists when it is missing."""
    base = name.removeprefix("mooncake-").removeprefix("mooncake/")
    if os.environ.get(DATA_DIR_ENV):
        root = data_dir() / "mooncake"
        for candidate in (root / f"{base}_trace.jsonl", root / f"{base}_trace.jsonl.gz"):
            if candidate.is_file():
                return candidate
        raise DataNotFoundError(
            f"trace {name!r} not found in ${DATA_DIR_ENV}: no {root}/{base}_trace.jsonl[.gz]"
        )
    path = packaged_data_dir() / f"{base}_trace.jsonl.gz"
    if not path.is_file():
        raise DataNotFoundError(
            f"unknown trace {name!r}: the shipped traces are {', '.join(TRACE_NAMES)}; "
            "pass a path to a .jsonl or .jsonl.gz file for any other"
        )
    return path


def resolve_trace(source: str | Path) -> Path:
    """A trace argument as a file: a path (anything with a separator or a ``.json``/
    ``.jsonl``/``.gz`` suffix, or an existing file) or a shipped trace's name."""
    if isinstance(source, Path):
        path = source
    elif os.sep in source or source.endswith((".jsonl", ".json", ".gz")) or Path(source).is_file():
        path = Path(source)
    else:
        return trace_path(source)
    if not path.is_file():
        raise DataNotFoundError(f"trace file not found: {path}")
    return path


def _open(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def _int(obj: dict[str, Any], name: str, where: str, minimum: int) -> int:
    v = obj.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TraceFormatError(f"{where}: {name} must be an int >= {minimum}, got {v!r}")
    return v


def _timestamp(obj: dict[str, Any], where: str, scale: float) -> float:
    for name, factor in (("timestamp_ms", 1.0), ("timestamp_s", 1000.0), ("timestamp", scale)):
        if name in obj:
            v = obj[name]
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v < 0
            ):
                raise TraceFormatError(f"{where}: {name} must be a number >= 0, got {v!r}")
            return float(v) * factor
    raise TraceFormatError(f"{where}: no timestamp (timestamp, timestamp_ms or timestamp_s)")


def _token_list(v: Any, name: str, where: str, *, allow_empty: bool) -> TokenIds:
    if not isinstance(v, list) or (not v and not allow_empty):
        raise TraceFormatError(f"{where}: {name} must be a non-empty list of token ids")
    try:
        if any(type(t) is not int for t in v):
            raise ValueError
        return TokenIds(v)
    except ValueError:
        raise TraceFormatError(f"{where}: {name} must hold ints in 0..{TOKEN_ID_MAX}") from None


def _parse(obj: Any, where: str, scale: float) -> tuple[float, int, int, tuple[int, ...], Any]:
    """(timestamp ms, input length, output length, hash ids, tokens or None) of one row."""
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: a row must be a JSON object")
    ts = _timestamp(obj, where, scale)
    if "hash_ids" in obj:
        n_in = _int(obj, "input_length", where, 1)
        ids = obj["hash_ids"]
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
        ):
            raise TraceFormatError(f"{where}: hash_ids must be a non-empty list of ints >= 0")
        n_out = _int(obj, "output_length", where, 0) if "output_length" in obj else 0
        return ts, n_in, n_out, tuple(ids), None
    tok_field = next((f for f in _TOKEN_FIELDS if f in obj), None)
    if tok_field is None:
        raise TraceFormatError(
            f"{where}: a row needs hash_ids (+ input_length) or the prompt's token ids "
            f"({', '.join(_TOKEN_FIELDS)})"
        )
    tokens = _token_list(obj[tok_field], tok_field, where, allow_empty=False)
    if "input_length" in obj and _int(obj, "input_length", where, 1) != len(tokens):
        raise TraceFormatError(
            f"{where}: input_length {obj['input_length']} but {len(tokens)} {tok_field}"
        )
    out_field = next((f for f in _OUTPUT_FIELDS if f in obj), None)
    if "output_length" in obj:
        n_out = _int(obj, "output_length", where, 0)
    elif out_field is not None:
        n_out = len(_token_list(obj[out_field], out_field, where, allow_empty=True))
    else:
        n_out = 0
    return ts, len(tokens), n_out, (), tokens


def infer_block_tokens(lengths: Iterable[tuple[int, int, int]], where: str = "line ") -> int | None:
    """The block size (tokens per hash id) consistent with every ``(line, input_length,
    number of hash ids)``: 512 when it fits (Mooncake), else the largest power of two that
    fits, else the smallest size that fits; None when there are no rows. TraceFormatError
    names (``where`` + line) the first line no size consistent with the earlier ones fits."""
    lo, hi = 1, TOKEN_ID_MAX
    seen = False
    for line, n, k in lengths:
        seen = True
        row_lo = -(-n // k)
        row_hi = (n - 1) // (k - 1) if k > 1 else TOKEN_ID_MAX
        if max(lo, row_lo) > min(hi, row_hi):
            raise TraceFormatError(
                f"{where}{line}: {k} hash_ids for input_length {n} fit no block size shared "
                f"with the rows before (those fit {lo}..{hi} tokens per id); pass the "
                "trace's block size explicitly"
            )
        lo, hi = max(lo, row_lo), min(hi, row_hi)
    if not seen:
        return None
    if lo <= MOONCAKE_BLOCK_TOKENS <= hi:
        return MOONCAKE_BLOCK_TOKENS
    p = 1 << (hi.bit_length() - 1)
    return p if p >= lo else lo


def load_trace(
    source: str | Path = "conversation",
    *,
    limit: int | None = None,
    block_tokens: int | None = None,
    time_unit: str = "ms",
) -> list[TraceRow]:
    """Rows of a trace (a shipped trace's name or a ``.jsonl``/``.jsonl.gz`` path), in
    arrival order, validated (see the module docstring). ``limit`` keeps the first rows of
    the file; ``block_tokens`` is the trace's tokens per hash id (inferred when None).

    Raises DataNotFoundError for a missing file, TraceFormatError (file:line: field) for a
    malformed row, and ConfigError-like ValueError for an unknown ``time_unit``.
    """
    if time_unit not in _TIME_UNITS:
        raise TraceFormatError(f"unknown time unit {time_unit!r}; use ms or s")
    if block_tokens is not None and block_tokens < 1:
        raise TraceFormatError(f"block_tokens must be >= 1, got {block_tokens}")
    scale = _TIME_UNITS[time_unit]
    path = resolve_trace(source)
    parsed: list[tuple[float, int, int, tuple[int, ...], Any, int]] = []
    try:
        with _open(path) as f:
            for lineno, text in enumerate(f, 1):
                if limit is not None and len(parsed) >= limit:
                    break
                if not text.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise TraceFormatError(f"{where}: not JSON ({exc.msg})") from None
                parsed.append((*_parse(obj, where, scale), lineno))
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{path}: cannot read the trace ({exc})") from None
    hashed = [(p[5], p[1], len(p[3])) for p in parsed if p[4] is None]
    if block_tokens is None:
        bt = infer_block_tokens(hashed, f"{path}:") or MOONCAKE_BLOCK_TOKENS
    else:
        bt = block_tokens
        for line, n, k in hashed:
            if k != -(-n // bt):
                raise TraceFormatError(
                    f"{path}:{line}: {k} hash_ids for input_length {n} (expected "
                    f"ceil({n}/{bt}) = {-(-n // bt)} with {bt}-token blocks)"
                )
    order = sorted(range(len(parsed)), key=lambda i: parsed[i][0])
    rows: list[TraceRow] = []
    for i in order:
        ts, n_in, n_out, ids, tokens, lineno = parsed[i]
        rows.append(TraceRow(len(rows), ts, n_in, n_out, ids, tokens, bt, lineno))
    return rows

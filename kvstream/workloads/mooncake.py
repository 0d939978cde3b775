"""Trace rows turned into token-level requests (DESIGN §9).

A hash-id row (Mooncake and similar traces, see :mod:`.traces`) gives ``input_length``,
``output_length`` and ``hash_ids``: prefix-chained ids of ``block_tokens``-token blocks (equal
ids mean equal content *and* equal prefix). Each id stands for a fixed pseudo-random list of
``block_tokens`` tokens (a function of the id and a seed), and a row's prompt is the
concatenation of its ids' lists cut to exactly ``input_length`` tokens (the last block is
usually partial). Hashing those tokens with any chained block hash reproduces the trace's
prefix structure, so a cache replay hits exactly where the trace says it can. A token-id row
is its own prompt.

How an id becomes tokens, cheaply enough for a whole trace (183k distinct ids in
conversation): one pseudo-random pool of :data:`POOL_TOKENS` tokens per seed (BLAKE3 XOF);
block ``h`` is the id written in base ``vocab_size`` (3 tokens, so distinct ids always give
distinct blocks) followed by a slice of the pool at an offset that is a hash of ``h``.
Outputs are pool slices keyed by the row index.

A hash-id row's prompt is built in one C call (:mod:`._mooncake_native`, built by ``pip install``
when a C compiler is present); the Python loop of :meth:`MooncakeTokens.prompt` is the reference,
the fallback (``native=False``; ``KVSTREAM_NO_NATIVE=1`` before import) and the path that
reports bad ids. Both give the same bytes (property-tested).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Final

from kvstream._native import load as load_native
from kvstream._types import TokenIds
from kvstream.errors import ConfigError
from kvstream.workloads.base import WorkloadRequest, pseudo_tokens
from kvstream.workloads.traces import (
    DATA_DIR_ENV,
    MOONCAKE_BLOCK_TOKENS,
    TRACE_NAMES,
    TraceRow,
    data_dir,
    load_trace,
    trace_path,
)

if TYPE_CHECKING:  # typed by its stub; None at run time when not loaded
    from kvstream.workloads import _mooncake_native
else:
    _mooncake_native = load_native("kvstream.workloads._mooncake_native")

__all__ = [
    "DATA_DIR_ENV",
    "MOONCAKE_BLOCK_TOKENS",
    "POOL_TOKENS",
    "TRACE_NAMES",
    "MooncakeTokens",
    "TraceRow",
    "data_dir",
    "load_trace",
    "mooncake_requests",
    "trace_path",
]

#: Tokens in the pseudo-random pool the blocks are cut from.
POOL_TOKENS: Final = 1 << 20
_STAMP: Final = 3  # tokens that spell the id at the head of its block
_MIX: Final = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads ids over the pool
_PACK: Final = struct.Struct("<3I").pack
_MASK: Final = 0xFFFFFFFFFFFFFFFF
_U32: Final = 1 << 32
#: Whether the C prompt builder is loaded (the default path of :meth:`MooncakeTokens.prompt`).
NATIVE_PROMPTS: Final[bool] = _mooncake_native is not None


class MooncakeTokens:
    """Maps hash ids and rows to tokens, deterministically for a given ``seed``.

    ``block(hash_id)`` is the id's fixed list of ``block_tokens`` tokens (512 by default);
    ``prompt(row)`` exactly ``input_length`` tokens (a token-id row's own tokens);
    ``output(row)`` ``output_length`` tokens keyed by the row index. Ids must be below
    ``vocab_size ** 3`` (1.6e13 for the default vocabulary) to stay distinct.

    ``native`` picks the C prompt builder: None (default) when built, False never, True
    required (ConfigError, a ValueError, when it is not available). Prompts are the same
    bytes either way.
    """

    def __init__(
        self, *, seed: int = 0, vocab_size: int = 32000, native: bool | None = None
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if native and _mooncake_native is None:
            raise ConfigError(
                "the Mooncake prompt C extension is not available "
                "(not built, or KVSTREAM_NO_NATIVE is set)"
            )
        self.seed = seed
        self.vocab_size = vocab_size
        self._pool = pseudo_tokens(b"mooncake-pool\x00%d" % seed, POOL_TOKENS, vocab_size).raw
        self._view = memoryview(self._pool)
        # the C builder's stamp is three u32 words (larger vocabularies: the Python path)
        self._c: Any = _mooncake_native if native is not False and vocab_size < _U32 else None
        #: Whether prompts of hash-id rows are built in C.
        self.native: bool = self._c is not None

    def _stamp(self, hash_id: int) -> bytes:
        v = self.vocab_size
        if hash_id >= v**_STAMP:
            raise ValueError(f"hash id {hash_id} is too large for vocab_size {v}")
        return _PACK(hash_id % v, (hash_id // v) % v, hash_id // (v * v))

    def _parts(self, hash_id: int, block_tokens: int) -> tuple[bytes, memoryview]:
        body = block_tokens - _STAMP
        span = POOL_TOKENS - body
        off = (((hash_id ^ self.seed) * _MIX) & _MASK) % span
        return self._stamp(hash_id), self._view[4 * off : 4 * (off + body)]

    def block(self, hash_id: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> TokenIds:
        """The ``block_tokens`` tokens of ``hash_id``."""
        if block_tokens <= _STAMP:  # too short for the stamp: tokens straight from the XOF
            key = b"mooncake\x00%d\x00%d" % (self.seed, hash_id)
            return pseudo_tokens(key, block_tokens, self.vocab_size)
        stamp, body = self._parts(hash_id, block_tokens)
        return TokenIds.from_bytes(stamp + body)

    def prompt(self, row: TraceRow) -> TokenIds:
        """The row's prompt: a token-id row's tokens, else its ids' tokens concatenated and
        cut to ``input_length``."""
        if row.tokens is not None:
            return row.tokens
        bt = row.block_tokens
        ids = row.hash_ids
        c = self._c
        if c is not None and bt > _STAMP:
            n = min(max(row.input_length, 0), len(ids) * bt)
            raw_c: bytes | None = c.prompt(self._pool, ids, self.seed, self.vocab_size, bt, n)
            if raw_c is not None:
                return TokenIds.from_bytes(raw_c)
        if bt <= _STAMP:
            raw = b"".join(self.block(h, bt).raw for h in row.hash_ids)
            return TokenIds.from_bytes(raw[: 4 * row.input_length])
        # _stamp and _parts inlined (a trace has ~300k blocks), and the prompt cut to
        # input_length before the join, so its bytes are copied once
        body = bt - _STAMP
        nbody = 4 * body
        span = POOL_TOKENS - body
        seed = self.seed
        v = self.vocab_size
        vv = v * v
        view = self._view
        pack = _PACK
        parts: list[bytes | memoryview] = []
        append = parts.append
        for h in row.hash_ids:
            if h >= vv * v:
                raise ValueError(f"hash id {h} is too large for vocab_size {v}")
            off = 4 * ((((h ^ seed) * _MIX) & _MASK) % span)
            append(pack(h % v, h // v % v, h // vv))
            append(view[off : off + nbody])
        excess = 4 * (len(row.hash_ids) * bt - row.input_length)
        while excess > 0 and parts:
            last = parts[-1]
            if len(last) <= excess:
                excess -= len(last)
                parts.pop()
            else:
                parts[-1] = last[: len(last) - excess]
                excess = 0
        return TokenIds.from_bytes(b"".join(parts))

    def output(self, row: TraceRow) -> TokenIds:
        """``output_length`` generated tokens for the row (a function of its index)."""
        n = row.output_length
        if n >= POOL_TOKENS:
            key = b"mooncake-out\x00%d\x00%d" % (self.seed, row.index)
            return pseudo_tokens(key, n, self.vocab_size)
        off = ((row.index * _MIX) & _MASK) % (POOL_TOKENS - n + 1)
        return TokenIds.from_bytes(self._view[4 * off : 4 * (off + n)])


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

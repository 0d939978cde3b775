"""Canonical CBOR (RFC 8949 §4.2.1 preferred/deterministic encoding) for vLLM's hash inputs.

vLLM's ``sha256_cbor`` hashes ``cbor2.dumps(obj, canonical=True)``. The objects it hashes are
built from ``None``, ints, ``bytes``, ``str`` and tuples, whose canonical encoding is just the
shortest-form head followed by the payload, and an array's encoding is its head followed by its
items' encodings. This module encodes those types directly (several times faster than
``cbor2.dumps``); anything else is delegated to ``cbor2.dumps(canonical=True)``, so
:func:`dumps` always equals it (the tests prove it with hypothesis).

Token arrays, the bulk of every payload, have dedicated encoders: :func:`token_array` for one
block (a lookup table for ids below 2**16) and :func:`token_arrays` for many blocks at once
(numpy, imported on first use: :mod:`kvstream.index.keys` needs only :func:`dumps`), and
:func:`block_arrays` for a request cut into equal blocks.
"""

from __future__ import annotations

from typing import Any, Final

import cbor2

from kvstream.hashing.blocks import u32_list

__all__ = ["block_arrays", "dumps", "head", "token_array", "token_arrays"]

_U64_LIMIT: Final = 2**64
_TABLE: list[bytes] | None = None
_TABLE_SIZE: Final = 1 << 18


def head(major: int, n: int) -> bytes:
    """The shortest head of major type ``major`` with argument ``n`` (``0 <= n < 2**64``)."""
    mt = major << 5
    if n < 24:
        return bytes((mt | n,))
    if n < 0x100:
        return bytes((mt | 24, n))
    if n < 0x10000:
        return bytes((mt | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((mt | 26,)) + n.to_bytes(4, "big")
    return bytes((mt | 27,)) + n.to_bytes(8, "big")


def dumps(obj: Any) -> bytes:
    """``cbor2.dumps(obj, canonical=True)``, fast for None/bool/int/bytes/str/tuple/list."""
    if obj is None:
        return b"\xf6"
    kind = type(obj)
    if kind is int:
        if 0 <= obj < _U64_LIMIT:
            return head(0, obj)
        if -_U64_LIMIT <= obj < 0:
            return head(1, -1 - obj)
    elif kind is bytes:
        payload: bytes = obj
        return head(2, len(payload)) + payload
    elif kind is str:
        data: bytes = obj.encode("utf-8")
        return head(3, len(data)) + data
    elif kind is tuple or kind is list:
        return head(4, len(obj)) + b"".join([dumps(x) for x in obj])
    elif kind is bool:
        return b"\xf5" if obj else b"\xf4"
    out: bytes = cbor2.dumps(obj, canonical=True)
    return out


def _table() -> list[bytes]:
    """Encodings of the uints below ``_TABLE_SIZE`` (built on first use: ~30 ms, ~12 MB).

    2**18 covers the vocabularies of current models (Llama 3: 128k, Gemma: 256k), so a
    block's encoding is one C-level ``join`` over table lookups.
    """
    global _TABLE  # noqa: PLW0603  (published by one atomic rebinding: thread-safe)
    table = _TABLE
    if table is None:
        table = [bytes((i,)) for i in range(24)]
        table += [bytes((0x18, i)) for i in range(24, 0x100)]
        table += [b"\x19" + i.to_bytes(2, "big") for i in range(0x100, 0x10000)]
        table += [b"\x1a" + i.to_bytes(4, "big") for i in range(0x10000, _TABLE_SIZE)]
        _TABLE = table
    return table


def token_array(raw: bytes) -> bytes:
    """Canonical CBOR of ``tuple(tokens)`` for u32 little-endian token bytes ``raw``."""
    toks = u32_list(raw)
    table = _table()
    try:
        body = b"".join(map(table.__getitem__, toks))
    except IndexError:  # an id >= _TABLE_SIZE
        body = b"".join([table[t] if t < _TABLE_SIZE else head(0, t) for t in toks])
    return head(4, len(toks)) + body


def token_arrays(raw: bytes, lengths: list[int], *, none_tail: bool = False) -> list[bytes]:
    """:func:`token_array` of each block of a request, vectorised over all its tokens.

    ``raw`` is every block's tokens concatenated (u32 little-endian), ``lengths`` the number of
    tokens of each block, in order. With ``none_tail`` each segment also ends with ``f6``
    (the ``None`` extra keys of vLLM's payload).

    Every item (array head, token, tail) becomes a packed 5-byte row ``head byte || argument
    (u32 big-endian)``; its canonical encoding is the head byte followed by the last 0, 1, 2
    or 4 argument bytes, so one boolean compress of the rows yields all segments at once.
    """
    if not lengths:
        return []
    import numpy as np

    row = np.dtype([("head", "u1"), ("arg", ">u4")])  # packed: 5 bytes per item
    v = np.frombuffer(raw, dtype="<u4")
    blk_len = np.asarray(lengths, dtype=np.int64)
    per = blk_len + (2 if none_tail else 1)
    blk_end = np.cumsum(per)
    blk_start = blk_end - per
    m = int(blk_end[-1])
    arg = np.empty(m, np.uint32)
    major = np.zeros(m, np.uint8)
    is_token = np.ones(m, bool)
    is_token[blk_start] = False
    arg[blk_start] = blk_len
    major[blk_start] = 0x80  # major type 4: array
    if none_tail:
        is_token[blk_end - 1] = False
        arg[blk_end - 1] = 22
        major[blk_end - 1] = 0xE0  # major 7, simple 22: null (f6)
    arg[is_token] = v
    k1 = arg >= 24
    k2 = arg >= 0x100
    k3 = arg >= 0x10000
    k1b, k2b, k3b = k1.view(np.uint8), k2.view(np.uint8), k3.view(np.uint8)
    head = major | np.where(k1, np.uint8(0x17) + k1b + k2b + k3b, arg.astype(np.uint8))
    body = _compact(row, head, arg, (k1, k2, k3))
    item_end = np.cumsum(1 + k1b + k2b + 2 * k3b, dtype=np.int64)
    bounds = [0, *item_end[blk_end - 1].tolist()]
    return [body[bounds[i] : bounds[i + 1]] for i in range(len(lengths))]


def _compact(row: Any, head: Any, arg: Any, reach: tuple[Any, Any, Any]) -> bytes:
    """The items' canonical bytes: each packed ``head || arg`` row (``row``: 5 bytes) cut to
    its head byte and the last 0, 1, 2 or 4 argument bytes (``reach``: whether the argument
    reaches 24, 0x100, 0x10000), in one boolean compress."""
    import numpy as np

    k1, k2, k3 = reach
    rows = np.empty(len(arg), row)
    rows["head"] = head
    rows["arg"] = arg
    keep = np.empty((len(arg), 5), bool)
    keep[:, 0] = True
    keep[:, 1] = k3
    keep[:, 2] = k3
    keep[:, 3] = k2
    keep[:, 4] = k1
    body: bytes = rows.view(np.uint8).compress(keep.ravel()).tobytes()
    return body


_ROW: Any = None


def block_arrays(raw: bytes, tokens_per_block: int) -> list[bytes]:
    """``token_arrays(raw, [tokens_per_block] * n, none_tail=True)`` for a request of ``n``
    equal blocks (``len(raw) == 4 * tokens_per_block * n``, ``1 <= tokens_per_block <
    2**32``): the same bytes from fewer numpy steps (the items of block ``i`` are row ``i``
    of one matrix, see :func:`token_arrays`).
    """
    global _ROW  # noqa: PLW0603  (built once; rebinding is atomic)
    import numpy as np

    row = _ROW
    if row is None:
        row = _ROW = np.dtype([("head", "u1"), ("arg", ">u4")])
    v = np.frombuffer(raw, dtype="<u4")
    n = len(v) // tokens_per_block
    w = tokens_per_block + 2
    arg = np.empty((n, w), np.uint32)
    arg[:, 0] = tokens_per_block
    arg[:, 1:-1] = v.reshape(n, tokens_per_block)
    arg[:, -1] = 22  # major 7, simple 22: null (f6)
    flat = arg.ravel()
    k1 = flat >= 24
    k2 = flat >= 0x100
    k3 = flat >= 0x10000
    k1b, k2b, k3b = k1.view(np.uint8), k2.view(np.uint8), k3.view(np.uint8)
    first = np.where(k1, np.uint8(0x17) + k1b + k2b + k3b, flat.astype(np.uint8)).reshape(n, w)
    first[:, 0] |= np.uint8(0x80)  # major type 4: array
    first[:, -1] |= np.uint8(0xE0)
    body = _compact(row, first.ravel(), flat, (k1, k2, k3))
    size = (1 + k1b + k2b + 2 * k3b).reshape(n, w)
    ends = size.sum(axis=1, dtype=np.int64).cumsum().tolist()
    return [body[a:b] for a, b in zip([0, *ends], ends, strict=False)]

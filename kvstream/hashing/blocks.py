"""Token blocks: coercing the accepted token containers to bytes, and cutting requests into blocks.

Every hasher takes a block of token ids as any of: ``list``/``tuple`` of ints, ``range``,
``array('I')``, a 1-D integer ``numpy.ndarray`` or :class:`kvstream._types.TokenIds` (the fast
path: its ``.raw`` bytes are used as they are). Token ids must lie in ``0..2**32-1``; anything
else raises :class:`~kvstream.errors.HashingError` naming the offending position.

TensorRT-LLM V2 keys also admit *digest tokens*: a 32-byte ``bytes`` element standing for a
multimodal item (see :mod:`kvstream.hashing.multimodal`). Only hashers that define such tokens
accept them (:func:`coerce_block` with ``digests=True``).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

from kvstream._types import TOKEN_ID_MAX, TokenIds
from kvstream.errors import HashingError

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "DIGEST_TOKEN_LEN",
    "MixedBlock",
    "TokenBlock",
    "Where",
    "coerce_block",
    "coerce_many",
    "coerce_tokens",
    "extra_ids_list",
    "plain_raws",
    "split_blocks",
    "u32_list",
]

#: Any container a hasher accepts as one block of token ids.
TokenBlock: TypeAlias = "Sequence[int] | TokenIds | array[int] | range | np.ndarray[Any, Any]"

#: Length of a digest token (a raw 32-byte multimodal content digest inside a token stream).
DIGEST_TOKEN_LEN = 32

_LITTLE = sys.byteorder == "little"
#: Packers for lists up to this length (``Struct.pack`` beats ``array('I', ...)`` by ~25%).
_STRUCT_MAX = 1024
_STRUCTS: dict[int, struct.Struct] = {}
_U64_MAX = 2**64 - 1


def _is_ndarray(obj: object) -> bool:
    """Whether ``obj`` is a numpy array, without importing numpy: one can only exist once a
    caller has imported it (``kvstream serve`` never does, and numpy costs it ~14 MiB of RSS)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(obj, numpy.ndarray)


def _is_int(obj: object) -> bool:
    """An ``int`` or a numpy integer scalar (not a bool)."""
    if isinstance(obj, int):
        return not isinstance(obj, bool)
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(obj, numpy.integer)


class MixedBlock(NamedTuple):
    """A block holding digest tokens as well as int tokens (TensorRT-LLM V2 multimodal form).

    ``raw`` holds the int tokens only (u32 little-endian); ``digests`` gives each digest
    token's position in the block and its 32 bytes; ``verbatim`` is the V2 byte stream (each
    int token as 4 LE bytes, each digest token as its 32 bytes, in block order).
    """

    raw: bytes
    digests: tuple[tuple[int, bytes], ...]
    verbatim: bytes
    length: int


def u32_list(raw: bytes) -> list[int]:
    """The u32 little-endian values packed in ``raw`` (length a multiple of 4) as ints."""
    if _LITTLE:
        out: list[int] = memoryview(raw).cast("I").tolist()
        return out
    arr = array("I")  # pragma: no cover
    arr.frombytes(raw)  # pragma: no cover
    arr.byteswap()  # pragma: no cover
    return arr.tolist()  # pragma: no cover


#: Where a block sits, for error messages: a label, or the block's index in a chain call
#: (formatted as ``blocks[i]`` only when an error is raised, keeping the hot path cheap).
Where: TypeAlias = "str | int"


def _label(where: Where) -> str:
    return f"blocks[{where}]" if isinstance(where, int) else where


def _bad_tokens(block: Any, where: Where) -> HashingError:
    """The clearest error for a block that failed the fast conversion."""
    where = _label(where)
    try:
        items = list(block)
    except TypeError:
        return HashingError(
            f"{where}: a block must be a sequence of token ids, got {type(block).__name__}"
        )
    for i, tok in enumerate(items):
        if isinstance(tok, (bytes, bytearray, memoryview)):
            return HashingError(
                f"{where}[{i}] is a {len(tok)}-byte digest token; this algorithm takes "
                "multimodal content through mm_keys, not inline digest tokens"
            )
        if not _is_int(tok):
            return HashingError(f"{where}[{i}] = {tok!r}: token ids must be ints")
        if not 0 <= int(tok) <= TOKEN_ID_MAX:
            return HashingError(
                f"{where}[{i}] = {int(tok)}: token ids must be in 0..{TOKEN_ID_MAX}"
            )
    return HashingError(f"{where}: invalid token block {block!r}")


def _ndarray_bytes(block: np.ndarray[Any, Any], where: Where) -> bytes:
    where = _label(where)
    if block.ndim != 1 or block.dtype.kind not in "iu":
        raise HashingError(
            f"{where}: a numpy token block must be a 1-D integer array, got "
            f"{block.ndim}-D {block.dtype}"
        )
    if block.size and (int(block.min()) < 0 or int(block.max()) > TOKEN_ID_MAX):
        bad = int(((block < 0) | (block > TOKEN_ID_MAX)).nonzero()[0][0])
        raise HashingError(
            f"{where}[{bad}] = {int(block[bad])}: token ids must be in 0..{TOKEN_ID_MAX}"
        )
    return block.astype("<u4", copy=False).tobytes()


def coerce_tokens(block: Any, where: Where = "block") -> bytes:
    """The token ids of one block as u32 little-endian bytes (4 bytes per token).

    Contract: accepts the containers listed in the module docstring; raises HashingError for
    ids outside ``0..2**32-1``, non-int ids, digest tokens, ``bytes``/``str`` (ambiguous: use
    ``TokenIds.from_bytes``) and non-sequences. Never copies a ``TokenIds``.
    """
    kind = type(block)
    if kind is TokenIds:
        raw: bytes = block._raw  # the slot behind .raw (a property call costs ~100 ns)
        return raw
    if (kind is list or kind is tuple) and len(block) <= _STRUCT_MAX:
        packer = _STRUCTS.get(len(block))
        if packer is None:
            packer = _STRUCTS.setdefault(len(block), struct.Struct(f"<{len(block)}I"))
        try:
            return packer.pack(*block)
        except struct.error:
            raise _bad_tokens(block, where) from None
    if kind is list or kind is tuple or kind is range:
        try:
            arr = array("I", block)
        except (OverflowError, TypeError):
            raise _bad_tokens(block, where) from None
        if not _LITTLE:  # pragma: no cover
            arr.byteswap()
        return arr.tobytes()
    if isinstance(block, TokenIds):
        return block.raw
    if _is_ndarray(block):
        return _ndarray_bytes(block, where)
    if isinstance(block, array) and block.typecode == "I":
        if _LITTLE:
            return block.tobytes()
        swapped = array("I", block)  # pragma: no cover
        swapped.byteswap()  # pragma: no cover
        return swapped.tobytes()  # pragma: no cover
    if isinstance(block, (bytes, bytearray, memoryview, str)) or not isinstance(block, Iterable):
        raise HashingError(
            f"{_label(where)}: a block must be a sequence of token ids, got {type(block).__name__}"
            + (
                " (use TokenIds.from_bytes for packed ids)"
                if isinstance(block, (bytes, bytearray, memoryview))
                else ""
            )
        )
    items = list(block)
    try:
        arr = array("I", items)
    except (OverflowError, TypeError):
        raise _bad_tokens(items, where) from None
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def coerce_many(blocks: Iterable[Any]) -> list[bytes]:
    """:func:`coerce_tokens` of every block of a chain call (errors name ``blocks[i]``).

    Raises HashingError for an empty block as well: every algorithm hashes non-empty blocks.
    """
    tids = TokenIds
    raws = [b._raw if type(b) is tids else coerce_tokens(b, i) for i, b in enumerate(blocks)]
    if not all(raws):
        raise HashingError(f"blocks[{raws.index(b'')}]: a block needs at least one token")
    return raws


def coerce_block(block: Any, where: Where = "block") -> bytes | MixedBlock:
    """Like :func:`coerce_tokens`, but a list/tuple may also hold 32-byte digest tokens.

    Returns plain bytes when the block holds int tokens only (the common, fast case) and a
    :class:`MixedBlock` when it holds at least one digest token.
    """
    try:
        return coerce_tokens(block, where)
    except HashingError:
        if not isinstance(block, (list, tuple)) or not any(
            isinstance(t, (bytes, bytearray, memoryview)) for t in block
        ):
            raise
    where = _label(where)
    ints: list[int] = []
    digests: list[tuple[int, bytes]] = []
    parts: list[bytes] = []
    for i, tok in enumerate(block):
        if isinstance(tok, (bytes, bytearray, memoryview)):
            d = bytes(tok)
            if len(d) != DIGEST_TOKEN_LEN:
                raise HashingError(
                    f"{where}[{i}]: a digest token must be {DIGEST_TOKEN_LEN} bytes, got {len(d)}"
                )
            digests.append((i, d))
            parts.append(d)
        else:
            one = coerce_tokens([tok], where=f"{where}[{i}]")
            ints.append(tok)
            parts.append(one)
    return MixedBlock(coerce_tokens(ints, where), tuple(digests), b"".join(parts), len(block))


def plain_raws(blocks: Sequence[Any]) -> list[bytes] | None:
    """Every block's u32 LE bytes (:func:`coerce_block`), or None when a block holds digest
    tokens. Bad blocks raise HashingError naming ``blocks[i]``; empty blocks are returned as
    they are (the caller's hash rejects them)."""
    raws: list[bytes] = []
    for i, b in enumerate(blocks):
        if type(b) is TokenIds:
            raws.append(b._raw)
            continue
        coerced = coerce_block(b, i)
        if isinstance(coerced, MixedBlock):
            return None
        raws.append(coerced)
    return raws


def extra_ids_list(extra_ids: Any, n_tokens: int, where: str = "token_extra_ids") -> list[int]:
    """Per-token extra ids (TensorRT-LLM prompt-table ids, unsigned 64-bit) as a list of ints.

    Raises HashingError unless there is exactly one id in ``0..2**64-1`` per token.
    """
    if isinstance(extra_ids, TokenIds):
        out = extra_ids.tolist()
    elif _is_ndarray(extra_ids):
        out = [int(v) for v in extra_ids.tolist()]
    elif isinstance(extra_ids, (bytes, bytearray, memoryview, str)) or not isinstance(
        extra_ids, Iterable
    ):
        raise HashingError(f"{where} must be a sequence of ints, got {type(extra_ids).__name__}")
    else:
        out = list(extra_ids)
    if len(out) != n_tokens:
        raise HashingError(f"{where} has {len(out)} entries for {n_tokens} tokens")
    for i, v in enumerate(out):
        if not _is_int(v) or not 0 <= v <= _U64_MAX:
            raise HashingError(f"{where}[{i}] = {v!r}: extra ids must be ints in 0..2**64-1")
    return [int(v) for v in out]


def split_blocks(
    tokens: Any,
    tokens_per_block: int,
    *,
    include_partial: bool = False,
    drop_last_token: bool = False,
) -> list[TokenIds]:
    """Cut a request's token ids into the blocks a cache would hash.

    ``drop_last_token`` first removes the last token (TensorRT-LLM's router hashes
    ``tokens[:-1]``: the last prompt token is never part of a stored block). The ids are then
    cut into consecutive chunks of ``tokens_per_block``; a trailing shorter chunk is kept only
    with ``include_partial`` (TensorRT-LLM's router keeps it; vLLM hashes full blocks only).

    - TensorRT-LLM router: ``split_blocks(t, tpb, drop_last_token=True, include_partial=True)``
    - vLLM: ``split_blocks(t, block_size)``

    Accepts any token container :func:`coerce_tokens` accepts; raises HashingError for bad ids
    or a ``tokens_per_block`` that is not a positive int.
    """
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int):
        raise HashingError(f"tokens_per_block must be an int, got {tokens_per_block!r}")
    if tokens_per_block <= 0:
        raise HashingError(f"tokens_per_block must be positive, got {tokens_per_block}")
    raw = coerce_tokens(tokens, "tokens")
    if drop_last_token and raw:
        raw = raw[:-4]
    step = 4 * tokens_per_block
    end = len(raw) if include_partial else len(raw) - len(raw) % step
    return [TokenIds.from_bytes(raw[i : i + step]) for i in range(0, end, step)]

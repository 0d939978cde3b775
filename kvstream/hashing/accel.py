"""The optional C accelerator of the SHA-256/BLAKE3 chains, and request packing helpers.

:mod:`kvstream.hashing._chainnative` (``_chainnative.c``, built by ``pip install`` when a C
compiler is present) hashes a whole request's chain in one call for ``v2_sha256(_64)``
(``u32`` encoding), ``vllm_sha256_cbor(_64)``, ``vllm_sha256(_64)`` (its pickle bytes built
in C), ``blake3(_64)`` and ``sglang_sha256_64`` (``u32`` pages): SHA-256 on the x86 SHA
extensions when the CPU has them (portable C otherwise), BLAKE3's compression on SSE4.1
registers (portable C otherwise) with the chunks of a block that do not hold the parent key
hashed for the whole request first, eight at a time on AVX2 (and for several requests at once,
``chain_many``: the requests' chains eight side by side, one per AVX2 lane), vLLM's canonical
CBOR token arrays four ids per step with SSE4.1. The hashers in :mod:`.trtllm`, :mod:`.vllm`,
:mod:`.vllm_pickle`, :mod:`.native` and :mod:`.sglang` use it by default and keep their
pure-Python loops as the reference and the fallback (``native=False`` per hasher;
``KVSTREAM_NO_NATIVE=1`` before import for all). Values are identical either way
(property-tested).

Also here, with pure-Python fallbacks: :func:`pack_request` (a request's ids as u32 LE bytes),
:func:`fingerprints` and :func:`same_prefix` (what the prefix cache of
:mod:`kvstream.hashing.prefix_cache` looks requests up with).
"""

from __future__ import annotations

import re
import struct
from typing import TYPE_CHECKING, Any, Final

from kvstream._native import load as load_native
from kvstream.errors import HashingError
from kvstream.hashing.blocks import coerce_tokens

if TYPE_CHECKING:  # typed by its stub; None at run time when not loaded
    from kvstream.hashing import _chainnative
else:
    _chainnative = load_native("kvstream.hashing._chainnative")

__all__ = [
    "KIND_BLAKE3",
    "KIND_CBOR",
    "KIND_PICKLE",
    "KIND_SGLANG",
    "KIND_V2",
    "NATIVE_CHAINS",
    "fingerprints",
    "json_ids",
    "native_chains",
    "pack_request",
    "py_json_ids",
    "same_prefix",
    "split",
]

#: Whether the C extension is loaded (the hashers' default path).
NATIVE_CHAINS: Final[bool] = _chainnative is not None
_native: Any = _chainnative  # typed Any: None when not built
#: Chain kinds of ``_chainnative.chain``.
KIND_V2: Final = 0
KIND_CBOR: Final = 1
KIND_BLAKE3: Final = 2
KIND_SGLANG: Final = 3
KIND_PICKLE: Final = 4


def native_chains(native: bool | None, algo: str) -> Any:
    """The C module a hasher should use: ``native`` None picks it when loaded, False never,
    True requires it (HashingError when it is not available)."""
    if native is None:
        return _native
    if not native:
        return None
    if _native is None:
        raise HashingError(
            f"the {algo} C extension is not available (not built, or KVSTREAM_NO_NATIVE is set)"
        )
    return _native


def pack_request(tokens: Any, drop_last_token: bool = False) -> bytes:
    """A request's token ids as u32 little-endian bytes, without the last one when
    ``drop_last_token``. Accepts what :func:`~kvstream.hashing.blocks.coerce_tokens` accepts
    (HashingError for bad ids, naming ``tokens[i]``); lists and tuples of ints are packed in C."""
    kind = type(tokens)
    if _native is not None and (kind is list or kind is tuple):
        raw: bytes | None = _native.pack(tokens, drop_last_token)
        if raw is not None:
            return raw
    raw = coerce_tokens(tokens, "tokens")
    return raw[:-4] if drop_last_token and raw else raw


def fingerprints(raw: bytes, stride: int, whole: bool = False) -> list[int]:
    """Fingerprints of ``raw[:k * stride]`` for ``k = 1 .. len(raw) // stride``, then, with
    ``whole`` and a partial last stride, the fingerprint of all of ``raw``.

    ``raw`` holds whole u32 ids and ``stride`` is a positive multiple of 4 (HashingError
    otherwise). Equal prefixes give equal fingerprints within one process (the pure-Python
    fallback uses Python's salted ``hash``); they are a candidate filter, not a proof of
    equality: callers confirm a hit with :func:`same_prefix`.
    """
    if _native is not None:
        out: list[int] = _native.fingerprints(raw, stride, whole)
        return out
    if stride < 4 or stride % 4 or len(raw) % 4:
        raise HashingError(
            f"stride must be a positive multiple of 4 (got {stride}), raw whole u32 ids"
        )
    fps: list[int] = []
    h = 0
    n = len(raw) // stride
    for k in range(n):
        h = hash((h, raw[k * stride : (k + 1) * stride]))
        fps.append(h)
    if whole and len(raw) % stride:
        fps.append(hash((h, raw[n * stride :])))
    return fps


def same_prefix(a: bytes, b: bytes, n: int) -> bool:
    """``a[:n] == b[:n]``, False when either is shorter than ``n``."""
    if _native is not None:
        same: bool = _native.same_prefix(a, b, n)
        return same
    return len(a) >= n and len(b) >= n and a[:n] == b[:n]


def split(blob: bytes, width: int, count: int) -> list[bytes]:
    """The first ``count`` ``width``-byte pieces of ``blob`` as new bytes objects."""
    if _native is not None:
        out: list[bytes] = _native.split(blob, width, count)
        return out
    if width < 1 or count < 0 or count > len(blob) // width:
        raise HashingError(f"cannot split {len(blob)} bytes into {count} pieces of {width}")
    return [blob[i * width : (i + 1) * width] for i in range(count)]


_JSON_IDS: Final = re.compile(
    rb"[ \t\n\r]*\[[ \t\n\r]*"
    rb"(?:(?:0|[1-9][0-9]*)(?:[ \t\n\r]*,[ \t\n\r]*(?:0|[1-9][0-9]*))*[ \t\n\r]*)?"
    rb"\][ \t\n\r]*"
)
_JSON_ID: Final = re.compile(rb"[0-9]+")
#: the C parser (None when not built, or built before it existed)
_json_ids_c: Any = getattr(_native, "json_ids", None)


def py_json_ids(text: bytes | bytearray | memoryview) -> bytes | None:
    """A JSON array of token ids as u32 LE bytes, read from its text: None unless the text
    is exactly ``[`` ws (id (ws ``,`` ws id)*)? ws ``]`` (ws around it too) with every id
    plain decimal digits (no sign, fraction, exponent or leading zero) of a value in
    ``0..2**32-1`` (then the caller's JSON decoder decides). Pure Python (the reference of
    the C path)."""
    data = bytes(text)
    if _JSON_IDS.fullmatch(data) is None:
        return None
    ids = [int(m) for m in _JSON_ID.findall(data)]
    if any(v > 0xFFFFFFFF for v in ids):
        return None
    return struct.pack(f"<{len(ids)}I", *ids)


def json_ids(text: bytes | bytearray | memoryview) -> bytes | None:
    """:func:`py_json_ids` in C when the extension is loaded (the same answers)."""
    if _json_ids_c is not None:
        out: bytes | None = _json_ids_c(text)
        return out
    return py_json_ids(text)

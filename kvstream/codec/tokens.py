"""Token id encodings of the Avro schemas' ``TokenPack`` (bit planes, varints, zstd).

A batch's token ids (unsigned 32-bit, all stored events concatenated) travel one of two ways:

* **Bit planes** (every schema version): a *low plane* (the low 16 bits of every id,
  little-endian uint16) and ``k`` *high bit planes* (bit 16+j of every id, packed 8 ids per
  byte, least significant bit first), ``k`` the smallest count with every id below
  ``2**(16+k)``: 17 bits per id for a 128k vocabulary. Stored events have kind ``STORED``.
* **Packed** (schema v4): the ids encoded as ``BIT_PLANES`` (the same layout in one byte
  string), ``VARINT`` (unsigned LEB128) or ``DELTA_VARINT`` (zig-zag LEB128 of the wrapping
  32-bit difference to the previous id), optionally ``ZSTD``-compressed. Stored events have kind
  ``STORED_PACKED``, which readers older than v4 skip as unknown.

:func:`encode_tokens` picks per batch (``"auto"``: the smallest, see :func:`encode_tokens`);
:func:`tokens_from_record` is the one place a decoded ``TokenPack`` record becomes ids, and
:func:`stored_kind` says which stored kind a batch's events must have. The schema ``doc`` of
``TokenPack`` states the formats for non-Python consumers. Varint coding and bit-plane packing
use the optional C accelerator ``kvstream.codec._tokens_native`` when built (numpy otherwise,
same bytes) and zstd the ``cramjam`` package (a dependency, imported on first use; ``auto``
refuses to write a batch it would compress without it rather than write other bytes).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from kvstream._native import load as load_native
from kvstream.errors import DecodeError, EncodeError

__all__ = [
    "MAX_HIGH_BITS",
    "STORED_KINDS",
    "TOKEN_ENCODINGS",
    "EncodedTokens",
    "PackedTokens",
    "decode_packed",
    "encode_tokens",
    "pack_tokens",
    "stored_kind",
    "tokens_from_record",
    "unpack_tokens",
    "zstd_limit",
]

#: Largest ``high_bits``: 16 planes above the low 16 bits cover the whole uint32 range.
MAX_HIGH_BITS: Final = 16
#: Event kind symbols of stored events: bit-plane ids, packed ids (v4).
STORED_KINDS: Final = frozenset({"STORED", "STORED_PACKED"})
#: What :func:`encode_tokens` accepts: ``auto``, the v3 layout ``planes``, or one packed form.
TOKEN_ENCODINGS: Final = (
    "auto",
    "planes",
    "varint",
    "delta_varint",
    "planes+zstd",
    "varint+zstd",
    "delta_varint+zstd",
)
_TRANSFORMS: Final = {"planes": "BIT_PLANES", "varint": "VARINT", "delta_varint": "DELTA_VARINT"}
_ZSTD_LEVEL: Final = 1  # measured: level 3-19 gain < 2% on token streams at 3-50x the CPU
_ZSTD_MIN_BYTES: Final = 512  # below this a zstd frame rarely pays for its ~20 bytes
_ZSTD_RATIO: Final = 256
_ZSTD_SLACK: Final = 1 << 20
#: ``auto`` packs only when that saves at least this fraction of the bit planes' bytes: batches
#: left in bit planes stay fully readable by v3 consumers.
_AUTO_MIN_SAVING: Final = 0.05
#: ``auto`` estimates varint sizes of long batches on this many windows of contiguous ids.
_SAMPLE_WINDOWS: Final = 16
_SAMPLE_WINDOW: Final = 512


@dataclass(frozen=True, slots=True)
class PackedTokens:
    """The four bit-plane ``TokenPack`` fields."""

    count: int
    high_bits: int
    low16: bytes
    high_planes: bytes


_EMPTY: Final = PackedTokens(0, 0, b"", b"")


@dataclass(frozen=True, slots=True)
class EncodedTokens:
    """A batch's ids as the eight v4 ``TokenPack`` fields: bit planes, or packed (not both).

    ``planes`` holds the bit-plane fields (empty when packed); ``encoding`` and
    ``compression`` are the ``TokenEncoding``/``TokenCompression`` symbols (``NONE`` when the
    ids are bit planes); ``count`` is the number of ids either way.
    """

    planes: PackedTokens
    encoding: str = "NONE"
    compression: str = "NONE"
    count: int = 0
    packed: bytes = b""

    @property
    def is_packed(self) -> bool:
        """True when the ids are in the packed fields (stored events: ``STORED_PACKED``)."""
        return self.encoding != "NONE"

    @property
    def wire_bytes(self) -> int:
        """Token payload bytes (without the Avro length prefixes)."""
        return len(self.planes.low16) + len(self.planes.high_planes) + len(self.packed)


# ------------------------------------------------------------------------------ bit planes


def _plane_bytes(count: int, high_bits: int) -> int:
    return 2 * count + high_bits * ((count + 7) >> 3)


def pack_tokens(raw: bytes) -> PackedTokens:
    """Pack little-endian uint32 ids (``len(raw) % 4 == 0``) into the bit-plane format."""
    if not raw:
        return _EMPTY
    if _planes_encode is not None:
        k, low, planes = _planes_encode(raw)
        return PackedTokens(len(raw) >> 2, k, low, planes)
    return _pack_tokens_np(raw)


def _pack_tokens_np(raw: bytes) -> PackedTokens:
    """numpy reference of :func:`pack_tokens` (and its fallback without the C extension)."""
    halves = np.frombuffer(raw, dtype="<u2")
    low = halves[0::2].tobytes()
    high = halves[1::2]
    k = int(high.max()).bit_length()
    if k == 0:
        planes = b""
    elif k == 1:
        planes = np.packbits(high.astype(np.bool_), bitorder="little").tobytes()
    else:
        # bits[i, b] = bit b of high[i]; rows of the transposed first k columns are the planes.
        bits = np.unpackbits(
            high.astype("<u2").view(np.uint8).reshape(-1, 2), axis=1, bitorder="little"
        )
        planes = np.packbits(bits[:, :k].T, axis=1, bitorder="little").tobytes()
    return PackedTokens(len(raw) >> 2, k, low, planes)


def unpack_tokens(
    count: int, high_bits: int, low16: bytes | memoryview, high_planes: bytes | memoryview
) -> bytes:
    """The ids of bit-plane fields as little-endian uint32 bytes (``4 * count`` bytes).

    Raises DecodeError when the fields are inconsistent: a negative count, ``high_bits``
    outside 0..16, plane lengths that do not match ``count``, or set padding bits.
    """
    if count < 0:
        raise DecodeError(f"tokens.count is negative ({count})")
    if not 0 <= high_bits <= MAX_HIGH_BITS:
        raise DecodeError(f"tokens.high_bits must be 0..{MAX_HIGH_BITS}, got {high_bits}")
    if len(low16) != 2 * count:
        raise DecodeError(
            f"tokens.low16 has {len(low16)} bytes; {count} token ids need {2 * count}"
        )
    plane_len = (count + 7) >> 3
    if len(high_planes) != high_bits * plane_len:
        raise DecodeError(
            f"tokens.high_planes has {len(high_planes)} bytes; {high_bits} planes of "
            f"{count} ids need {high_bits * plane_len}"
        )
    if count == 0:
        return b""
    ids = np.frombuffer(low16, dtype="<u2").astype("<u4")
    if high_bits:
        planes = np.frombuffer(high_planes, dtype=np.uint8).reshape(high_bits, plane_len)
        pad = count & 7
        if pad and np.any(planes[:, -1] >> pad):
            raise DecodeError("tokens.high_planes has padding bits set after the last id")
        bits = np.unpackbits(planes, axis=1, count=count, bitorder="little")
        high = np.zeros(count, dtype="<u4")
        for j in range(high_bits):
            high |= bits[j].astype("<u4") << np.uint32(j)
        ids |= high << np.uint32(16)
    return ids.tobytes()


# ------------------------------------------------------------------------------ varints


def _varint_sizes(z: np.ndarray) -> np.ndarray:
    """Bytes of each value's LEB128 varint (uint8 array)."""
    nb = np.ones(len(z), dtype=np.uint8)
    for bits in (7, 14, 21, 28):
        nb += z >= (1 << bits)
    return nb


def _varint_size(z: np.ndarray) -> int:
    total = len(z)
    for bits in (7, 14, 21, 28):
        total += int(np.count_nonzero(z >= (1 << bits)))
    return total


def _zigzag_deltas(ids: np.ndarray) -> np.ndarray:
    d = np.diff(ids, prepend=np.uint32(0)).view(np.int32)  # wrapping 32-bit differences
    return ((d << 1) ^ (d >> 31)).view(np.uint32)


def _varint_encode_np(raw: bytes, delta: bool) -> bytes:
    ids = np.frombuffer(raw, dtype="<u4")
    z = _zigzag_deltas(ids) if delta else ids
    if not len(z):
        return b""
    nb = _varint_sizes(z)
    width = int(nb.max())
    if width == 1:
        return z.astype(np.uint8).tobytes()
    ends = np.cumsum(nb, dtype=np.intp)
    starts = ends - nb
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    out[starts] = (z & 0x7F).astype(np.uint8) | ((nb > 1).astype(np.uint8) << 7)
    for k in range(1, width):
        idx = np.flatnonzero(nb > k)
        group = ((z[idx] >> np.uint32(7 * k)) & 0x7F).astype(np.uint8)
        out[starts[idx] + k] = group | ((nb[idx] > k + 1).astype(np.uint8) << 7)
    return out.tobytes()


def _varint_decode_np(data: bytes | memoryview, count: int, delta: bool) -> bytes:
    """``count`` canonical LEB128 varints filling ``data`` exactly -> uint32 LE bytes."""
    b = np.frombuffer(data, dtype=np.uint8)
    last = b < 0x80
    ends = np.flatnonzero(last)
    if len(ends) != count or (count and ends[-1] != len(b) - 1) or (not count and len(b)):
        tail = ", the last one unterminated" if len(b) and not last[-1] else ""
        raise DecodeError(
            f"tokens.packed: {len(b)} varint bytes do not hold exactly {count} ids "
            f"({len(ends)} varints{tail})"
        )
    if not count:
        return b""
    if len(b) == count:
        z = b.astype(np.uint32)
    else:
        starts = np.empty(count, dtype=np.intp)
        starts[0] = 0
        np.add(ends[:-1], 1, out=starts[1:])
        lens = ends - starts  # continuation bytes per varint
        if int(lens.max()) > 4:
            raise DecodeError("tokens.packed: a varint is longer than 5 bytes")
        multi = np.flatnonzero(lens)
        if not b[ends[multi]].all():
            raise DecodeError("tokens.packed: a varint has a redundant trailing zero group")
        # group k of every varint longer than k, one pass per group over those varints only
        z = b[starts].astype(np.uint32)
        z[multi] &= np.uint32(0x7F)
        idx = multi
        for k in range(1, 5):
            g = b[starts[idx] + k].astype(np.uint32)
            more = lens[idx] > k
            if k == 4:  # the fifth group holds bits 28..31 only
                if np.any(g > 0x0F):
                    raise DecodeError("tokens.packed: a varint exceeds 32 bits")
            else:
                g[more] &= np.uint32(0x7F)
            z[idx] |= g << np.uint32(7 * k)
            idx = idx[more]
            if not len(idx):
                break
    if delta:
        d = (z >> np.uint32(1)) ^ (np.uint32(0) - (z & np.uint32(1)))
        z = np.cumsum(d, dtype=np.uint32)
    return z.astype("<u4").tobytes()


def _varint_sizes_np(raw: bytes) -> tuple[int, int, int]:
    ids = np.frombuffer(raw, dtype="<u4")
    if not len(ids):
        return 0, 0, 0
    return int(ids.max()), _varint_size(ids), _varint_size(_zigzag_deltas(ids))


_Encode = Callable[[bytes, bool], bytes]
_Planes = Callable[[bytes], tuple[int, bytes, bytes]]
_Decode = Callable[[bytes | memoryview, int, bool], bytes]
_Sizes = Callable[[bytes], tuple[int, int, int]]


def _native() -> tuple[_Encode, _Decode, _Sizes, _Planes | None]:
    mod: Any = load_native("kvstream.codec._tokens_native")
    if mod is None:
        return _varint_encode_np, _varint_decode_np, _varint_sizes_np, None

    def decode(data: bytes | memoryview, count: int, delta: bool) -> bytes:
        try:
            out: bytes = mod.varint_decode(data, count, delta)
        except ValueError as exc:
            raise DecodeError(f"tokens.packed: {exc}") from None
        return out

    return mod.varint_encode, decode, mod.varint_sizes, mod.planes_encode


_varint_encode, _varint_decode, _varint_sizes_of, _planes_encode = _native()
#: Whether the C varint coder is in use (else numpy, same bytes).
NATIVE: Final = _varint_encode is not _varint_encode_np


# ------------------------------------------------------------------------------ zstd


def _cramjam() -> Any:
    try:
        return importlib.import_module("cramjam")
    except ImportError:
        return None


def zstd_limit(compressed_len: int) -> int:
    """Largest decompressed size a reader accepts: 1 MiB + 256 x the compressed size."""
    return _ZSTD_SLACK + _ZSTD_RATIO * compressed_len


def _zstd_compress(data: bytes) -> bytes | None:
    cj = _cramjam()
    if cj is None:
        return None
    out = bytes(cj.zstd.compress(data, level=_ZSTD_LEVEL))
    return out if len(data) <= zstd_limit(len(out)) else None


def _zstd_decompress(data: bytes | memoryview, expected_max: int) -> memoryview:
    cj = _cramjam()
    if cj is None:
        raise DecodeError("tokens.packed is zstd-compressed; install cramjam to read it")
    limit = min(expected_max, zstd_limit(len(data)))
    buf = bytearray(limit + 1)
    try:
        n = cj.zstd.decompress_into(data, buf)
    except cj.DecompressionError as exc:
        raise DecodeError(
            f"tokens.packed: not zstd data of at most {limit} bytes ({exc})"
        ) from None
    if n > limit:  # pragma: no cover - decompress_into stops at the buffer's end
        raise DecodeError(f"tokens.packed decompresses to more than {limit} bytes")
    return memoryview(buf)[:n]  # no copy: the decoders read any buffer


# ------------------------------------------------------------------------------ choosing


def _packed(transform: str, raw: bytes, n: int, zstd: bool) -> EncodedTokens:
    if transform == "BIT_PLANES":
        p = pack_tokens(raw)
        data = p.low16 + p.high_planes
    else:
        data = _varint_encode(raw, transform == "DELTA_VARINT")
    compression = "NONE"
    if zstd:
        z = _zstd_compress(data)
        if z is None:
            raise EncodeError(
                "zstd token compression needs the cramjam package and data compressing "
                f"at most {_ZSTD_RATIO}x"
            )
        data, compression = z, "ZSTD"
    return EncodedTokens(_EMPTY, transform, compression, n, data)


def encode_tokens(raw: bytes, encoding: str = "auto") -> EncodedTokens:
    """The ``TokenPack`` fields of little-endian uint32 ids ``raw``, encoded as ``encoding``.

    ``encoding`` is one of :data:`TOKEN_ENCODINGS`. ``planes`` is the v3 layout, readable by
    every version. ``auto`` (the default) computes the sizes of both varint forms in one pass
    (over 16 windows of 512 contiguous ids for batches of more than 8192 ids); when the
    smaller one beats bit planes it encodes it, zstd-compresses it when it has
    at least 512 bytes (keeping that if smaller), and packs when the result saves at least 5%
    over bit planes. Otherwise the batch stays in bit planes, readable by v3 readers (ids
    spread evenly enough for planes to beat varints are incompressible, so ``auto`` does not
    spend a zstd pass on them). The choice and the bytes depend only on ``raw``
    (deterministic): without cramjam, a batch that ``auto`` would compress raises EncodeError
    instead of being written differently. Raises EncodeError for an unknown ``encoding``, or
    ``+zstd`` without cramjam.
    """
    n = len(raw) >> 2
    if encoding == "planes" or not raw:
        if encoding not in TOKEN_ENCODINGS:
            raise EncodeError(f"unknown token encoding {encoding!r}; known: {TOKEN_ENCODINGS}")
        planes = pack_tokens(raw)
        return EncodedTokens(planes, count=n)
    if encoding != "auto":
        transform, _, comp = encoding.partition("+")
        if transform not in _TRANSFORMS or comp not in ("", "zstd"):
            raise EncodeError(f"unknown token encoding {encoding!r}; known: {TOKEN_ENCODINGS}")
        return _packed(_TRANSFORMS[transform], raw, n, comp == "zstd")
    if n > _SAMPLE_WINDOWS * _SAMPLE_WINDOW:
        top = int(np.frombuffer(raw, dtype="<u4").max())
        step = 4 * (n // _SAMPLE_WINDOWS)
        span = 4 * _SAMPLE_WINDOW
        sample = b"".join(raw[i : i + span] for i in range(0, _SAMPLE_WINDOWS * step, step))
        _, varint_size, delta_size = _varint_sizes_of(sample)
        scale = n / (len(sample) >> 2)
        varint_size, delta_size = int(varint_size * scale), int(delta_size * scale)
    else:  # the sizes' pass reads every id: its maximum is the batch's
        top, varint_size, delta_size = _varint_sizes_of(raw)
    plane_size = _plane_bytes(n, (top >> 16).bit_length())
    transform = "VARINT" if varint_size <= delta_size else "DELTA_VARINT"
    if min(varint_size, delta_size) >= plane_size:
        return EncodedTokens(pack_tokens(raw), count=n)
    data = _varint_encode(raw, transform == "DELTA_VARINT")
    compression = "NONE"
    if len(data) >= _ZSTD_MIN_BYTES:
        if _cramjam() is None:
            # Never a silent fallback: the bytes ``auto`` writes must not depend on what is
            # installed (an environment without cramjam once wrote 25% larger Zipf batches).
            raise EncodeError(
                "token_encoding='auto' zstd-compresses this batch's ids, which needs the "
                "cramjam package (a kvstream dependency): install it, or write "
                "token_encoding='varint' or 'planes'"
            )
        z = _zstd_compress(data)
        if z is not None and len(z) < len(data):
            data, compression = z, "ZSTD"
    if len(data) > plane_size * (1 - _AUTO_MIN_SAVING):
        return EncodedTokens(pack_tokens(raw), count=n)
    return EncodedTokens(_EMPTY, transform, compression, n, data)


# ------------------------------------------------------------------------------ decoding


def decode_packed(encoding: str, compression: str, count: int, data: bytes | memoryview) -> bytes:
    """The ids of packed ``TokenPack`` fields as little-endian uint32 bytes.

    Raises DecodeError for an unknown encoding or compression symbol, a negative count, data
    that does not decompress or decode to exactly ``count`` ids, non-canonical varints, and
    zstd content over :func:`zstd_limit`.
    """
    if count < 0:
        raise DecodeError(f"tokens.packed_count is negative ({count})")
    if encoding not in ("BIT_PLANES", "VARINT", "DELTA_VARINT"):
        raise DecodeError(f"token encoding {encoding} unknown to this reader")
    exact = _plane_bytes(count, MAX_HIGH_BITS) if encoding == "BIT_PLANES" else 5 * count
    if compression == "ZSTD":
        data = _zstd_decompress(data, exact)
    elif compression != "NONE":
        raise DecodeError(f"token compression {compression} unknown to this reader")
    if encoding == "BIT_PLANES":
        plane_len = (count + 7) >> 3
        extra = len(data) - 2 * count
        if extra < 0 or (extra and (not plane_len or extra % plane_len)):
            raise DecodeError(
                f"tokens.packed: {len(data)} bytes are not the bit planes of {count} ids"
            )
        high_bits = extra // plane_len if plane_len else 0
        return unpack_tokens(count, high_bits, data[: 2 * count], data[2 * count :])
    if len(data) > exact:
        raise DecodeError(f"tokens.packed: {len(data)} bytes of varints for {count} ids")
    return _varint_decode(data, count, encoding == "DELTA_VARINT")


def _is_packed(tok: Mapping[str, Any]) -> bool:
    encoding = tok.get("packed_encoding", "NONE")
    if encoding == "NONE":
        if (
            tok.get("packed_compression", "NONE") != "NONE"
            or tok.get("packed_count", 0)
            or tok.get("packed", b"")
        ):
            raise DecodeError("tokens: packed_encoding is NONE but the packed fields are set")
        return False
    if tok["count"] or tok["high_bits"] or tok["low16"] or tok["high_planes"]:
        raise DecodeError(
            f"tokens: packed_encoding is {encoding} but the bit-plane fields are set too"
        )
    return True


def stored_kind(tok: Mapping[str, Any]) -> str:
    """The kind symbol every stored event of the batch whose ``TokenPack`` record is ``tok``
    must have: ``STORED_PACKED`` when its ids are packed, else ``STORED``.

    A stored event of the other kind is malformed (decoders raise DecodeError): a reader older
    than v4 would resolve that batch differently. Raises DecodeError for a record holding both.
    """
    return "STORED_PACKED" if _is_packed(tok) else "STORED"


def tokens_from_record(tok: Mapping[str, Any]) -> bytes:
    """The ids of a decoded ``TokenPack`` record (fastavro's dict) as little-endian uint32 bytes.

    The one place every decoder (model and columnar) turns the batch's token record into ids,
    for records of any schema version (fields a version lacks take the v4 defaults). Both kinds
    of stored event (:data:`STORED_KINDS`) consume these ids in event order; check the kind
    with :func:`stored_kind`. Raises DecodeError.
    """
    if _is_packed(tok):
        return decode_packed(
            tok["packed_encoding"],
            tok.get("packed_compression", "NONE"),
            tok["packed_count"],
            tok["packed"],
        )
    return unpack_tokens(tok["count"], tok["high_bits"], tok["low16"], tok["high_planes"])

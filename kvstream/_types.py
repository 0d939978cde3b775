"""Small shared value types: block hashes, token id arrays, cache levels, priorities.

Layer L0: imports nothing from kvstream except :mod:`kvstream.errors`.
"""

from __future__ import annotations

import operator
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Final, SupportsIndex, overload

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

__all__ = [
    "BLOCK_HASH_WIDTHS",
    "CacheLevel",
    "PRIORITY_DEFAULT",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "TOKEN_ID_MAX",
    "TokenIds",
    "TokenIdsView",
    "hash_from_hex",
    "hash_from_int",
    "hash_to_hex",
    "hash_to_int",
    "hash_width",
]

PRIORITY_MIN: Final = 0
PRIORITY_MAX: Final = 100
PRIORITY_DEFAULT: Final = 35
TOKEN_ID_MAX: Final = 2**32 - 1

#: Width in bytes of the hashes each known ``hash_algo`` publishes. 64-bit algorithms publish
#: 8 bytes (the unsigned value, big-endian), 256-bit ones the 32-byte digest. An algorithm not
#: listed here (a newer producer's) may publish 8 or 32 bytes; the model checks consistency only.
BLOCK_HASH_WIDTHS: Final[dict[str, int]] = {
    "v1_block_key": 8,
    "v2_sha256": 32,
    "v2_sha256_64": 8,
    "vllm_sha256_cbor": 32,
    "vllm_sha256_cbor_64": 8,
    "vllm_sha256": 32,
    "vllm_sha256_64": 8,
    "sglang_sha256_64": 8,
    "dynamo_xxh3_64": 8,
    "blake3": 32,
    "blake3_64": 8,
}
ALLOWED_UNKNOWN_WIDTHS: Final = (8, 16, 32)


class CacheLevel(IntEnum):
    """Where a block lives. Index into ``num_blocks_per_cache_level``."""

    GPU = 0
    HOST = 1
    DISK = 2
    #: Outside this engine (a shared remote store: SGLang ``EXTERNAL``, Dynamo's External tier).
    EXTERNAL = 3


def hash_width(hash_algo: str) -> int | None:
    """Byte width of ``hash_algo``'s published hashes, or None for an unknown algorithm."""
    return BLOCK_HASH_WIDTHS.get(hash_algo)


def hash_to_int(block_hash: bytes) -> int:
    """The unsigned integer a hash stands for (big-endian), as TensorRT-LLM/vLLM put in JSON."""
    return int.from_bytes(block_hash, "big", signed=False)


def hash_from_int(value: int, width: int = 8) -> bytes:
    """Bytes of an integer hash.

    Accepts the unsigned form (``0 <= value < 2**(8*width)``) and, for convenience with
    TensorRT-LLM's ZMQ/gRPC wire forms, the signed two's-complement form
    (``-2**(8*width-1) <= value < 0``). Raises ValueError when it does not fit.
    """
    bits = 8 * width
    if value < 0:
        if value < -(1 << (bits - 1)):
            raise ValueError(f"hash {value} does not fit in {width} signed bytes")
        value += 1 << bits
    if value >> bits:
        raise ValueError(f"hash {value} does not fit in {width} bytes")
    return value.to_bytes(width, "big")


def hash_to_hex(block_hash: bytes) -> str:
    """Lowercase hex, as TensorRT-LLM publishes ``v2_sha256`` hashes."""
    return block_hash.hex()


def hash_from_hex(text: str) -> bytes:
    """Bytes of a hex hash; raises ValueError on non-hex text or an odd length."""
    return bytes.fromhex(text)


if array("I").itemsize != 4:  # pragma: no cover - every supported platform has 4-byte unsigned int
    raise ImportError("kvstream needs a platform whose C unsigned int is 4 bytes")
_LITTLE: Final = sys.byteorder == "little"


class TokenIds(Sequence[int]):
    """An immutable array of token ids (unsigned 32-bit), stored as little-endian bytes.

    It behaves like a tuple of ints (indexing, slicing, iteration, equality with lists and
    tuples) while keeping the compact ``raw`` form that hashing and the Avro codec consume
    without touching each int again. Construction from ints raises ValueError for ids
    outside ``0..2**32-1``.
    """

    __slots__ = ("_raw",)
    _raw: bytes

    def __init__(self, values: Iterable[int] = ()) -> None:
        if isinstance(values, TokenIds):
            self._raw = values._raw
            return
        if isinstance(values, (bytes, bytearray, memoryview, str)):
            raise TypeError("TokenIds(ints): use TokenIds.from_bytes() for packed bytes")
        try:
            arr = array("I", values)
        except OverflowError:
            raise ValueError(f"token ids must be in 0..{TOKEN_ID_MAX}") from None
        except TypeError:
            # numpy integer scalars and other int-like objects: go through __index__
            try:
                arr = array("I", [operator.index(v) for v in values])
            except OverflowError:
                raise ValueError(f"token ids must be in 0..{TOKEN_ID_MAX}") from None
        if not _LITTLE:  # pragma: no cover
            arr.byteswap()
        self._raw = arr.tobytes()

    @classmethod
    def from_bytes(cls, raw: bytes | bytearray | memoryview) -> TokenIds:
        """Wrap little-endian uint32 bytes (length must be a multiple of 4)."""
        data = bytes(raw)
        if len(data) % 4:
            raise ValueError(f"packed token ids need a multiple of 4 bytes, got {len(data)}")
        self = cls.__new__(cls)
        self._raw = data
        return self

    if TYPE_CHECKING:

        @property
        def raw(self) -> bytes:
            """The ids as little-endian uint32 bytes (4 bytes per token)."""
            return self._raw

    else:
        # No Python frame behind it (native readers, e.g. the Avro encoder, read it per block)
        raw = property(
            operator.attrgetter("_raw"),
            doc="The ids as little-endian uint32 bytes (4 bytes per token).",
        )

    def _array(self) -> array[int]:
        arr = array("I")
        arr.frombytes(self._raw)
        if not _LITTLE:  # pragma: no cover
            arr.byteswap()
        return arr

    def tolist(self) -> list[int]:
        """The ids as a list of ints."""
        if _LITTLE:
            return memoryview(self._raw).cast("I").tolist()
        return self._array().tolist()  # pragma: no cover

    def __len__(self) -> int:
        return len(self._raw) >> 2

    @overload
    def __getitem__(self, index: SupportsIndex) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> TokenIds: ...
    def __getitem__(self, index: SupportsIndex | slice) -> int | TokenIds:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return TokenIds.from_bytes(self._raw[start * 4 : max(start, stop) * 4])
            return TokenIds(self.tolist()[index])
        i = index.__index__()
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("token index out of range")
        return int.from_bytes(self._raw[i * 4 : i * 4 + 4], "little")

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self._raw == other._raw
        if isinstance(other, (list, tuple, array)):
            return self.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._raw)

    def __repr__(self) -> str:
        ids = self.tolist()
        if len(ids) > 12:
            return f"TokenIds([{', '.join(map(str, ids[:12]))}, ...] len={len(ids)})"
        return f"TokenIds({ids})"

    def __add__(self, other: TokenIds) -> TokenIds:
        if not isinstance(other, TokenIds):
            return NotImplemented
        return TokenIds.from_bytes(self._raw + other._raw)

    @classmethod
    def _validate(cls, value: Any) -> TokenIds:
        if isinstance(value, TokenIds):
            return value
        if isinstance(value, (bytes, bytearray, memoryview, str)) or not isinstance(
            value, Iterable
        ):
            raise ValueError("token ids must be a sequence of ints")
        try:
            return cls(value)
        except TypeError:
            raise ValueError("token ids must be ints") from None

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            cls._validate,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda v: v.tolist(), when_used="json"
            ),
        )

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": TOKEN_ID_MAX},
        }


#: The member descriptor of TokenIds' ``_raw`` slot (TokenIdsView fills it on first read).
_RAW_SLOT: Final = TokenIds.__dict__["_raw"]


class TokenIdsView(TokenIds):
    """Block ``i`` of a packed run of equal-length blocks, sharing the run's bytes: the same
    value as ``TokenIds.from_bytes(packed[i * step : (i + 1) * step])`` (equal to it and to
    its ints, the same hash, ``repr`` and JSON), with the block's own bytes cut only when
    something first reads them (``raw``, iteration, indexing, hashing, equality), then kept.
    ``len`` reads nothing. Pickling and copying give that plain :class:`TokenIds`. Until
    its first read a view keeps the whole run's bytes alive; after it, only its own.

    The event builders make one per block of a stored chain (a cache's commit), where most
    consumers read a block's hash and token count, never its ids: no 2 KB copy per block.
    Make them with :meth:`of_run`; they are never mutated.
    """

    __slots__ = ("_i", "_run")
    _run: tuple[bytes, int]  # (the packed run's bytes, bytes per block), shared by its blocks
    _i: int

    @classmethod
    def of_run(cls, packed: bytes, k: int) -> tuple[TokenIdsView, ...]:
        """The ``k`` blocks of ``packed`` (little-endian uint32 ids, ``k`` equal blocks: its
        length a multiple of ``4 * k``), one view each; raises ValueError otherwise."""
        if not isinstance(packed, bytes) or k <= 0 or len(packed) % (4 * k):
            raise ValueError(f"{k} equal blocks of packed token ids, got {len(packed)} bytes")
        run = (packed, len(packed) // k)
        new = cls.__new__
        out = []
        for i in range(k):
            view = new(cls)
            view._run = run
            view._i = i
            out.append(view)
        return tuple(out)

    if TYPE_CHECKING:

        @property
        def run(self) -> tuple[bytes, int]:
            """Typing stub; the run-time property below carries the contract."""
            return self._run

        @property
        def run_index(self) -> int:
            """Typing stub; the run-time property below carries the contract."""
            return self._i

    else:
        # Attribute reads with no Python code behind them and no allocation: native readers
        # (the Avro encoder) take a chain's ids for two attribute lookups per block.
        run = property(
            operator.attrgetter("_run"),
            doc="""``(packed, step)``: the run of equal blocks this view reads, shared by
            all of them (its bytes, ``step`` bytes per block); the view's ids are
            ``packed[run_index * step : (run_index + 1) * step]``. Reading it neither
            copies nor cuts. Raises AttributeError once the view has cut its own bytes
            (then read ``raw``).""",
        )
        run_index = property(
            operator.attrgetter("_i"), doc="This view's block number in :attr:`run`."
        )

    @property
    def _raw(self) -> bytes:  # type: ignore[override]  # the block's bytes, cut on first read
        try:
            raw: bytes = _RAW_SLOT.__get__(self, TokenIds)
        except AttributeError:
            packed, step = self._run
            at = self._i * step
            raw = packed[at : at + step]
            _RAW_SLOT.__set__(self, raw)
            del self._run  # a view kept after its first read keeps its block, not the chain
        return raw

    def __len__(self) -> int:
        try:
            return self._run[1] >> 2
        except AttributeError:  # cut already
            return len(self._raw) >> 2

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenIds.from_bytes, (self._raw,))

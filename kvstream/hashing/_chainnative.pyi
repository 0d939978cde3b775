"""Type stub of the optional C extension ``kvstream.hashing._chainnative`` (``_chainnative.c``).

Whole-request SHA-256/BLAKE3 block-hash chains (``v2_sha256``, ``vllm_sha256_cbor``,
``vllm_sha256``, ``blake3``, ``sglang_sha256_64``; see :mod:`kvstream.hashing.accel`, which
wraps it). Bad inputs raise :class:`kvstream.errors.HashingError`.
"""

from collections.abc import Sequence
from typing import Final

from typing_extensions import Buffer

KIND_V2: Final[int]
KIND_CBOR: Final[int]
KIND_BLAKE3: Final[int]
KIND_SGLANG: Final[int]
KIND_PICKLE: Final[int]

def chain(
    kind: int,
    tokens: Buffer | Sequence[Buffer],
    block_tokens: int,
    parent: Buffer,
    start: int = 0,
    width: int = 32,
    offset: int = 0,
    first_tail: Buffer | None = None,
    tail: Buffer | None = None,
    every: int = 0,
) -> tuple[list[bytes], list[bytes]]: ...
def chain_ints(
    kind: int,
    tokens: list[int] | tuple[int, ...],
    block_tokens: int,
    parent: Buffer,
    start: int = 0,
    width: int = 32,
    offset: int = 0,
    first_tail: Buffer | None = None,
    tail: Buffer | None = None,
    every: int = 0,
    drop_last: bool = False,
) -> tuple[bytes, tuple[list[bytes], list[bytes]]] | None: ...
def chain_many(
    kind: int,
    raws: Sequence[Buffer],
    block_tokens: int,
    parent: Buffer,
    width: int = 32,
    offset: int = 0,
) -> list[tuple[list[bytes], list[bytes]]]: ...
def pack(tokens: list[int] | tuple[int, ...], drop_last: bool = False) -> bytes | None: ...
def fingerprints(raw: Buffer, stride: int, whole: bool = False, /) -> list[int]: ...
def same_prefix(a: Buffer, b: Buffer, n: int, /) -> bool: ...
def split(blob: Buffer, width: int, count: int, /) -> list[bytes]: ...
def sha256(data: Buffer, /) -> bytes: ...
def blake3(data: Buffer, /) -> bytes: ...
def has_sha_ni() -> bool: ...
def set_simd(on: bool, /) -> bool: ...
def dynamo_keys(
    tokens: list[int] | tuple[int, ...] | Buffer,
    block_tokens: int,
    seed: int,
    parent: bytes,
    drop_last: bool = False,
    /,
) -> list[bytes] | None: ...
def dynamo_link(
    local_hashes: Sequence[bytes] | Sequence[int], parent: bytes, signed: bool, /
) -> list[bytes] | None: ...
def json_ids(text: Buffer, /) -> bytes | None: ...

"""Type stub of the optional C extension ``kvstream.hashing._v1native`` (``_v1native.c``).

TensorRT-LLM ``v1_block_key`` chains in C; :mod:`kvstream.hashing.trtllm` holds the
pure-Python reference and documents the algorithm. Bad inputs raise
:class:`kvstream.errors.HashingError`.

``tokens`` is one buffer of uint32 little-endian ids cut by ``block_sizes`` (an int: tokens per
block, the last block may be shorter; or a sequence of positive sizes summing to the token
count), or a list/tuple of per-block buffers (``block_sizes`` None). ``parent`` is the first
block's parent (0 = root); ``salt_id`` is mixed into any block whose parent is 0, ``lora_id``
into every block. ``extra_ids``: None, one buffer of uint64 little-endian ids (one per token),
or one entry per block (None or a buffer). ``mm_keys``: None or one entry per block (None or a
buffer of :data:`MM_RECORD_SIZE`-byte records: 32-byte digest || uint32 LE start_offset).
"""

from collections.abc import Sequence
from typing import Final

from typing_extensions import Buffer

ALGORITHM: Final[str]
MM_RECORD_SIZE: Final[int]

def chain(
    tokens: Buffer | Sequence[Buffer],
    block_sizes: int | Sequence[int] | None = None,
    parent: int = 0,
    salt_id: int | None = None,
    lora_id: int | None = None,
    extra_ids: Buffer | Sequence[Buffer | None] | None = None,
    mm_keys: Sequence[Buffer | None] | None = None,
) -> list[int]:
    """The chain as unsigned 64-bit ints."""

def chain_bytes(
    tokens: Buffer | Sequence[Buffer],
    block_sizes: int | Sequence[int] | None = None,
    parent: int = 0,
    salt_id: int | None = None,
    lora_id: int | None = None,
    extra_ids: Buffer | Sequence[Buffer | None] | None = None,
    mm_keys: Sequence[Buffer | None] | None = None,
) -> list[bytes]:
    """The chain, each hash as 8 bytes big-endian."""

def chain_buffer(
    tokens: Buffer | Sequence[Buffer],
    block_sizes: int | Sequence[int] | None = None,
    parent: int = 0,
    salt_id: int | None = None,
    lora_id: int | None = None,
    extra_ids: Buffer | Sequence[Buffer | None] | None = None,
    mm_keys: Sequence[Buffer | None] | None = None,
) -> bytes:
    """The chain's 8-byte big-endian hashes, concatenated."""

def block_key(
    tokens: Buffer,
    parent: int = 0,
    salt_id: int | None = None,
    lora_id: int | None = None,
    extra_ids: Buffer | None = None,
    mm_keys: Buffer | None = None,
) -> int:
    """The hash of one block."""

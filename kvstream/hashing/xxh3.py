"""XXH3 digests for the layers above ``hashing`` (the only area, with ``cache``, that
imports ``xxhash``): the index's ``kvstream_tokens_v2`` keys (:mod:`kvstream.index.keys`) and
the per-block loops of its Dynamo keys."""

from __future__ import annotations

from typing import Final

from xxhash import xxh3_64_digest, xxh3_128_digest

__all__ = ["xxh3_64", "xxh3_128"]

#: ``xxh3_128(data) -> bytes``: XXH3-128 of ``data`` (seed 0) as 16 bytes in XXH3's canonical
#: big-endian form (``XXH128_canonicalFromHash``), what the C paths write.
xxh3_128: Final = xxh3_128_digest

#: ``xxh3_64(data, seed=0) -> bytes``: XXH3-64 of ``data`` as 8 big-endian bytes:
#: :func:`kvstream.hashing.dynamo.local_hash` (with its seed) and
#: :func:`~kvstream.hashing.dynamo.link_hash` (seed 0), for loops that call it per block.
xxh3_64: Final = xxh3_64_digest

"""XXH3-128 digests for the layers above ``hashing`` (the only area, with ``cache``, that
imports ``xxhash``): the index's ``kvstream_tokens_v2`` keys (:mod:`kvstream.index.keys`)."""

from __future__ import annotations

from typing import Final

from xxhash import xxh3_128_digest

__all__ = ["xxh3_128"]

#: ``xxh3_128(data) -> bytes``: XXH3-128 of ``data`` (seed 0) as 16 bytes in XXH3's canonical
#: big-endian form (``XXH128_canonicalFromHash``), what the C paths write.
xxh3_128: Final = xxh3_128_digest

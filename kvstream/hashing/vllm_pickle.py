"""vLLM's default prefix-cache hash: ``vllm_sha256`` and ``vllm_sha256_64``.

vLLM's ``prefix_caching_hash_algo="sha256"`` (the default) is ``vllm.utils.hashing.sha256``:
SHA-256 of ``pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)`` (protocol 5 on every Python
vLLM supports), applied to the same ``(parent_digest, tuple(tokens), extra_keys)`` inputs and
``NONE_HASH = H(seed)`` as ``sha256_cbor`` (see :mod:`kvstream.hashing.vllm` for the seed, the
extra keys, multimodal offsets, LoRA, salt and prompt embeds). kvstream builds the same Python
objects and pickles them with Python's own :mod:`pickle`, so the bytes are vLLM's.

Pickle output depends on object *identity* as well as values: an object met twice in one
payload is written the second time as a memo reference. vLLM's engine core decodes each request
from msgpack, so the strings of a block's extra keys (LoRA name and path, salt, multimodal
identifiers) are distinct objects, while its tags (``"lora"``, ``"mm"``, ...) are code
constants shared by every key. kvstream reproduces that: tags are shared constants and every
other string is placed in the payload as its own copy (CPython, like msgpack decoding, shares
the empty and one-character Latin-1 strings). An in-process engine that reuses one str object
for two multimodal items of the same block would pickle a memo reference instead.

Published: ``vllm_sha256`` the 32-byte digest; ``vllm_sha256_64`` its last 8 bytes, big-endian
(what vLLM puts in events with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default).
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Final

from kvstream.errors import HashingError
from kvstream.hashing.vllm import VllmHasherBase

__all__ = ["VllmSha256PickleHasher"]

#: ``pickle.HIGHEST_PROTOCOL`` of every Python vLLM 0.29+ runs on (3.10-3.13).
PICKLE_PROTOCOL: Final = 5


class VllmSha256PickleHasher(VllmHasherBase):
    """vLLM's default ``sha256`` prefix hash (``width`` 32) or its published u64 form (8).

    Same parameters as :class:`~kvstream.hashing.vllm.VllmSha256CborHasher`; only ``H`` and
    the identity of the strings in the hashed objects differ.
    """

    algo = "vllm_sha256"

    def hash_object(self, obj: Any) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=PICKLE_PROTOCOL)).digest()

    @staticmethod
    def _str(value: str) -> str:
        # A fresh str object (see the module docstring on memo references).
        try:
            return value.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")
        except UnicodeError as exc:  # pragma: no cover - surrogatepass round-trips any str
            raise HashingError(f"cannot hash string {value!r}: {exc}") from None

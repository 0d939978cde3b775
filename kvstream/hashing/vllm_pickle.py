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

**In C.** A block's payload is ``PROTO 5``, one ``FRAME``, the parent as ``SHORT_BINBYTES``,
the token tuple (each id as pickle writes ints: ``BININT1``/``BININT2``/``BININT``/``LONG1``)
and the extra keys; only the extra keys hold objects whose identity matters, and their bytes
are the same for every block of a request but the first (the salt). So the C chain
(:mod:`kvstream.hashing.accel`, ``native=`` as for ``vllm_sha256_cbor``) builds the payloads
itself, with the extra keys' bytes pickled here by :mod:`pickle` once per request; blocks
with multimodal keys or prompt embeds, and payloads that would not fit one pickle frame
(64 KiB), take the pickle path. Equal bytes either way (property-tested).

Published: ``vllm_sha256`` the 32-byte digest; ``vllm_sha256_64`` its last 8 bytes, big-endian
(what vLLM puts in events with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default).
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Final

from kvstream.errors import HashingError
from kvstream.hashing.accel import KIND_PICKLE
from kvstream.hashing.base import ChainState, PerBlock
from kvstream.hashing.vllm import VllmHasherBase, _as_tuple

__all__ = ["VllmSha256PickleHasher"]

#: ``pickle.HIGHEST_PROTOCOL`` of every Python vLLM 0.29+ runs on (3.10-3.13).
PICKLE_PROTOCOL: Final = 5
#: The pickle of ``(parent, (0,), extra)`` up to the token tuple's MEMOIZE: PROTO 5, FRAME
#: (length at [3:11]), SHORT_BINBYTES 32 + parent, MEMOIZE, BININT1 0, TUPLE1, MEMOIZE. What
#: follows (the extra keys, memo from 2 whatever the tokens, then TUPLE3 MEMOIZE STOP) is the
#: C chain's tail.
_HEAD: Final = b"\x80\x05\x95"
_AFTER_FRAME: Final = b"C\x20" + bytes(32) + b"\x94K\x00\x85\x94"
_TAIL_AT: Final = 11 + len(_AFTER_FRAME)
#: Blocks the C chain builds (one pickle frame: payloads below pickle's 64 KiB frame target;
#: an id takes at most 7 bytes, the extra keys at most _MAX_TAIL).
_MAX_C_TOKENS: Final = 8192
_MAX_TAIL: Final = 4096


def _pickle_tail(extra: tuple[Any, ...] | None) -> bytes | None:
    """The bytes pickle writes after a block's token tuple for extra keys ``extra`` (None when
    pickle frames it differently than the C chain assumes)."""
    p = pickle.dumps((bytes(32), (0,), extra), protocol=PICKLE_PROTOCOL)
    tail = p[_TAIL_AT:]
    if (
        p[:3] != _HEAD
        or int.from_bytes(p[3:11], "little") != len(p) - 11
        or p[11:_TAIL_AT] != _AFTER_FRAME
        or len(tail) > _MAX_TAIL
    ):
        return None
    return tail


#: The request scope (LoRA key, salt key) of a request with neither, and its tails (no extra
#: keys: NONE, TUPLE3, MEMOIZE, STOP).
_NO_SCOPE: Final = (None, None)
_PLAIN_TAILS: Final = (b"N\x87\x94.", b"N\x87\x94.")


class VllmSha256PickleHasher(VllmHasherBase):
    """vLLM's default ``sha256`` prefix hash (``width`` 32) or its published u64 form (8).

    Same parameters as :class:`~kvstream.hashing.vllm.VllmSha256CborHasher`; only ``H`` and
    the identity of the strings in the hashed objects differ.
    """

    algo = "vllm_sha256"
    _c_kind = KIND_PICKLE

    def hash_object(self, obj: Any) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=PICKLE_PROTOCOL)).digest()

    def _tails(self, state: ChainState) -> tuple[bytes, bytes] | None:
        """The C chain's tails (pickled extra keys) of the block after ``state`` and of the
        rest; None when the C chain cannot build them."""
        scope = state.scope
        if scope == _NO_SCOPE:
            return _PLAIN_TAILS
        rest = _pickle_tail(_as_tuple(self._keys(scope, False, None, None)))
        first = rest
        if state.depth == 0 and scope[1] is not None:  # the salt: first block only
            first = _pickle_tail(_as_tuple(self._keys(scope, True, None, None)))
        if first is None or rest is None:
            return None
        return first, rest

    def _c_args(
        self, state: ChainState, tokens_per_block: int
    ) -> tuple[bytes, int, bytes | None, bytes | None] | None:
        tails = self._tails(state) if tokens_per_block <= _MAX_C_TOKENS else None
        if tails is None:
            return None
        # the 64-bit form publishes the digest's last 8 bytes
        return state.key, 32 - self.width, tails[0], tails[1]

    def _digests(
        self, state: ChainState, raws: list[bytes], mm: PerBlock, embeds: PerBlock
    ) -> list[bytes]:
        c = self._c
        if c is not None and mm is None and embeds is None:
            tails = self._tails(state)
            if tails is not None and all(len(r) <= 4 * _MAX_C_TOKENS for r in raws):
                digests: list[bytes] = c.chain(
                    KIND_PICKLE, raws, 0, state.key, 0, 32, 0, tails[0], tails[1]
                )[0]
                return digests
        return super()._digests(state, raws, mm, embeds)

    @staticmethod
    def _str(value: str) -> str:
        # A fresh str object (see the module docstring on memo references).
        try:
            return value.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")
        except UnicodeError as exc:  # pragma: no cover - surrogatepass round-trips any str
            raise HashingError(f"cannot hash string {value!r}: {exc}") from None

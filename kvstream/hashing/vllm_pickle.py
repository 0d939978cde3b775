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
from collections.abc import Iterable, Sequence
from typing import Any, Final

from kvstream.errors import HashingError
from kvstream.hashing.base import ChainState, per_block_args
from kvstream.hashing.blocks import coerce_many, coerce_tokens, u32_list
from kvstream.hashing.vllm import VllmHasherBase, _embeds_list

__all__ = ["VllmSha256PickleHasher"]

#: ``pickle.HIGHEST_PROTOCOL`` of every Python vLLM 0.29+ runs on (3.10-3.13).
PICKLE_PROTOCOL: Final = 5
_tuple_new = tuple.__new__


class VllmSha256PickleHasher(VllmHasherBase):
    """vLLM's default ``sha256`` prefix hash (``width`` 32) or its published u64 form (8).

    Same parameters as :class:`~kvstream.hashing.vllm.VllmSha256CborHasher`.
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

    def _digest(self, parent: bytes, raw: bytes, keys: list[Any]) -> bytes:
        payload = (parent, tuple(u32_list(raw)), tuple(keys) if keys else None)
        return hashlib.sha256(pickle.dumps(payload, protocol=PICKLE_PROTOCOL)).digest()

    def extend(
        self,
        state: ChainState,
        block_tokens: Any,
        mm_keys: Iterable[Any] | None = (),
        token_extra_ids: Any = None,
        *,
        prompt_embeds: bytes | None = None,
    ) -> tuple[bytes, ChainState]:
        """Hash one block: SHA-256(pickle((parent, tokens, extra_keys)))."""
        if type(state) is not ChainState or state.algo != self.name:
            self._check_state(state)
        if token_extra_ids is not None:
            raise HashingError("vLLM block hashes have no per-token extra ids")
        raw = coerce_tokens(block_tokens, "block_tokens")
        if not raw:
            raise HashingError("a block needs at least one token")
        keys = self._keys(state.scope, state.depth == 0, mm_keys, prompt_embeds)
        digest = self._digest(state.key, raw, keys)
        published = digest if self.width == 32 else digest[-8:]
        return published, _tuple_new(ChainState, (self.name, digest, state.depth + 1, state.scope))

    def chain_bytes(
        self,
        blocks: Iterable[Any],
        lora_id: int | None = None,
        cache_salt: str | None = None,
        salt_id: int | None = None,
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        mm_keys: Sequence[Iterable[Any] | None] | None = None,
        token_extra_ids: Sequence[Any] | None = None,
        prompt_embeds: Sequence[bytes | None] | None = None,
    ) -> list[bytes]:
        """The chain as bytes of width ``self.width``. See :meth:`BlockHasher.chain_bytes`."""
        blocks = list(blocks)
        mm, extra = per_block_args(len(blocks), mm_keys, token_extra_ids)
        if extra is not None and any(e is not None for e in extra):
            raise HashingError("vLLM block hashes have no per-token extra ids")
        embeds = _embeds_list(prompt_embeds, len(blocks))
        state = self.root(lora_id, cache_salt, salt_id, lora_name, lora_path=lora_path)
        raws = coerce_many(blocks)
        scope = state.scope
        parent: bytes = state.key
        out: list[bytes] = []
        for i, raw in enumerate(raws):
            if not raw:
                raise HashingError(f"blocks[{i}]: a block needs at least one token")
            keys = self._keys(
                scope,
                i == 0,
                None if mm is None else mm[i],
                None if embeds is None else embeds[i],
            )
            parent = self._digest(parent, raw, keys)
            out.append(parent)
        if self.width == 8:
            return [d[-8:] for d in out]
        return out

"""NVIDIA Dynamo's per-block local hash: ``dynamo_xxh3_64``.

Dynamo's KV router navigates its radix tree by a hash of each block's own tokens
(``LocalBlockHash``, the ``tokens_hash`` of its events), not chained to the parent block::

    tokens_hash = XXH3-64(block tokens as u32 little-endian [|| mm hashes], seed)
    seed        = 1337 (+ XXH3-64(lora_name, seed 0)) (+ XXH3-64(cache_namespace, seed 1))

Additions wrap mod 2**64 and empty strings count as absent. ``cache_namespace`` is Dynamo's
resolved request ``cache_salt`` (PR ai-dynamo/dynamo#8197), so kvstream's ``cache_salt`` feeds
it. A block with multimodal objects appends their ``mm_hash`` values (u64), sorted ascending, as
u64 little-endian after the tokens; their offsets are not hashed. Sources: ``lib/kv-router/src/
protocols.rs`` (``compute_block_hash_for_seq``, ``block_hash_seed``, ``hash_mm_identifier``)
and ``dynamo-kv-hashing``'s ``compute_salt_hash``; checked against ai-dynamo-runtime 1.6.1's
``dynamo.llm.compute_block_hash_for_seq(tokens, kv_block_size, block_mm_infos, lora_name,
is_eagle, cache_namespace)``, which hashes the full blocks of a sequence.

The chain state carries only the seed: every block hashes independently of its parent, so
``extend`` ignores the parent and equal blocks under the same scope hash equally at any depth.
EAGLE mode hashes overlapping windows of ``block_size + 1`` tokens: pass each block with the
next block's first token appended.

``mm_keys`` hashes map to Dynamo's u64 ``mm_hash``: an int as is; a 32-byte content digest (or
its 64-character hex) as its first 8 bytes big-endian (``int(hex[:16], 16)``); any other
identifier string as XXH3-64 of its UTF-8 (seed 0), Dynamo's ``hash_mm_identifier``.
LoRA adapters are identified by ``lora_name`` (a ``lora_id`` alone raises HashingError); a
numeric ``salt_id`` and per-token extra ids raise HashingError.
"""

from __future__ import annotations

import string
import struct
from collections.abc import Iterable
from typing import Any, Final

import xxhash

from kvstream._types import TokenIds
from kvstream.errors import HashingError
from kvstream.hashing.base import BlockHasher, ChainState, HashScope, PerBlock, name_scope
from kvstream.hashing.blocks import coerce_many, coerce_tokens
from kvstream.hashing.multimodal import normalize_mm_keys

__all__ = [
    "LOCAL_HASH_SEED",
    "DynamoXxh3Hasher",
    "block_hash_seed",
    "link_hash",
    "local_hash",
    "mm_hash_u64",
    "mm_suffix",
]

#: Dynamo's ``XXH3_SEED`` for local block hashes.
LOCAL_HASH_SEED: Final = 1337
_LORA_SEED: Final = 0
_NAMESPACE_SEED: Final = 1
_M64: Final = 2**64 - 1
_HEX: Final = frozenset(string.hexdigits)
_xxh3 = xxhash.xxh3_64_intdigest
_xxh3_be = xxhash.xxh3_64_digest  # the 8 bytes big-endian, as ``_xxh3(...).to_bytes(8, "big")``
_tuple_new = tuple.__new__


def local_hash(raw: bytes | memoryview, seed: int = LOCAL_HASH_SEED) -> bytes:
    """Dynamo's local hash (8 bytes big-endian) of one block's u32 LE tokens ``raw``."""
    return _xxh3_be(raw, seed)


def link_hash(parent_key: bytes, local: bytes) -> bytes:
    """XXH3-64 (8 bytes big-endian) of ``parent_key || local``: how kvstream's Dynamo-keyed
    index chains a block's local hash under its parent's key
    (:mod:`kvstream.index.keys`)."""
    return _xxh3_be(parent_key + local)


def block_hash_seed(lora_name: str | None = None, cache_namespace: str | None = None) -> int:
    """The XXH3 seed of a request's local block hashes (empty strings count as absent)."""
    seed = LOCAL_HASH_SEED
    if lora_name:
        seed += _xxh3(lora_name.encode("utf-8"), seed=_LORA_SEED)
    if cache_namespace:
        seed += _xxh3(cache_namespace.encode("utf-8"), seed=_NAMESPACE_SEED)
    return seed & _M64


def mm_hash_u64(value: object, where: str = "mm_key") -> int:
    """Dynamo's u64 ``mm_hash`` of a multimodal key hash (see the module docstring)."""
    if type(value) is int:
        if not 0 <= value <= _M64:
            raise HashingError(f"{where}: an int mm hash must be in 0..2**64-1, got {value}")
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if len(raw) != 32:
            raise HashingError(f"{where}: a content digest is 32 bytes, got {len(raw)}")
        return int.from_bytes(raw[:8], "big")
    if isinstance(value, str):
        if not value:
            raise HashingError(f"{where}: an empty multimodal identifier has no hash")
        if len(value) == 64 and _HEX.issuperset(value):
            return int(value[:16], 16)
        return int(_xxh3(value.encode("utf-8")))
    raise HashingError(f"{where}: hash must be bytes, str or int, got {type(value).__name__}")


def mm_suffix(mm_keys: Any) -> bytes:
    """The bytes a block's multimodal keys append to its tokens: their u64 ``mm_hash``
    values, sorted ascending, little-endian."""
    keys = normalize_mm_keys(mm_keys, int_hashes=True)
    hashes = sorted(mm_hash_u64(h, f"mm_keys[{i}]") for i, (h, _) in enumerate(keys))
    return struct.pack(f"<{len(hashes)}Q", *hashes)


class DynamoXxh3Hasher(BlockHasher):
    """``dynamo_xxh3_64``: Dynamo's unchained per-block ``tokens_hash`` (module docstring)."""

    name = "dynamo_xxh3_64"
    width = 8
    _no_extra_ids = "Dynamo block hashes have no per-token extra ids"

    def _root(self, scope: HashScope) -> ChainState:
        """Root state: key None (blocks do not chain); scope = (XXH3 seed,)."""
        name_scope(
            self.name,
            scope,
            no_salt_id="Dynamo hashes the cache_salt string (its cache_namespace); a numeric "
            "salt_id is not used",
        )
        return ChainState(self.name, None, 0, (block_hash_seed(scope.lora_name, scope.cache_salt),))

    def extend(
        self,
        state: ChainState,
        block_tokens: Any,
        mm_keys: Iterable[Any] | None = (),
        token_extra_ids: Any = None,
    ) -> tuple[bytes, ChainState]:
        """Hash one block: XXH3-64(tokens [|| sorted mm hashes], seed); the parent is unused."""
        if type(state) is not ChainState or state.algo != self.name:
            self._check_state(state)
        if token_extra_ids is not None:
            raise HashingError(self._no_extra_ids)
        if type(block_tokens) is TokenIds:
            raw: bytes = block_tokens._raw
        else:
            raw = coerce_tokens(block_tokens, "block_tokens")
        if not raw:
            raise HashingError("a block needs at least one token")
        if mm_keys:
            raw += mm_suffix(mm_keys)
        value: int = _xxh3(raw, seed=state.scope[0])
        return value.to_bytes(8, "big"), _tuple_new(
            ChainState, (self.name, None, state.depth + 1, state.scope)
        )

    def _chain(
        self, state: ChainState, blocks: list[Any], mm: PerBlock, extra: PerBlock
    ) -> list[bytes]:
        seed = state.scope[0]
        raws = coerce_many(blocks)
        if mm is None:
            return [_xxh3_be(raw, seed) for raw in raws]
        return [
            _xxh3(raw + mm_suffix(m) if m else raw, seed=seed).to_bytes(8, "big")
            for raw, m in zip(raws, mm, strict=True)
        ]

    def _chain_raw(
        self, state: ChainState, raw: bytes, tokens_per_block: int, start: int, every: int
    ) -> tuple[list[bytes], list[Any]]:
        """See :meth:`BlockHasher.chain_raw`: each block hashed straight from a view of ``raw``
        (blocks do not chain, so the chain keys are all None)."""
        self._check_state(state)
        step = 4 * tokens_per_block
        end = len(raw) // step * step
        seed = state.scope[0]
        view = memoryview(raw)
        out = [_xxh3_be(view[i : i + step], seed) for i in range(start * step, end, step)]
        n_keys = 0 if every <= 0 else end // step // every - start // every
        return out, [None] * n_keys

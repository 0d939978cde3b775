"""kvstream's own block hash on BLAKE3: ``blake3`` (256-bit) and ``blake3_64`` (64-bit).

Definition (version 1; any change needs a new name)::

    scope = one mask byte (bit0 lora_id present, bit1 salt present), then each present field
            as uint64 little-endian, lora first                  (exactly v2_sha256's scope)
    root  = BLAKE3(scope)                                        (no scope: BLAKE3(b"\\x00"))

    plain block (int tokens only, no mm_keys, no extra ids):
        key = BLAKE3(parent_key (32 bytes) || each token as uint32 little-endian)

    structured block (any digest token, mm key or per-token extra ids):
        key = BLAKE3-derive_key(context "kvstream.hashing.blake3 structured block v1",
                  parent_key (32)
                  || u32(n_int) || each int token as u32
                  || u32(n_digest_tokens) || for each: u32(position in block) || digest (32)
                  || u32(n_mm_keys)       || for each: digest (32) || u32(start_offset)
                  || u32(n_extra_ids)     || each extra id as u64)
        all integers little-endian; n_extra_ids is 0 without extra ids, else n_int

A cache salt string maps to its id as for TensorRT-LLM (SHA-256(utf-8)[:8] little-endian).
Salt and LoRA enter through the root only, so every block of a scoped request differs from the
unscoped one. Multimodal content enters like v2's digest tokens (a 32-byte element of the
block) and/or as ``mm_keys``; unlike v2, structured blocks use BLAKE3's key-derivation mode and
a self-delimiting layout, so a multimodal block can never collide with a text block whose token
bytes happen to spell a digest. ``blake3_64`` publishes the first 8 key bytes, big-endian;
chaining uses the full keys.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from blake3 import blake3

from kvstream._types import TokenIds
from kvstream.errors import HashingError
from kvstream.hashing.accel import KIND_BLAKE3, native_chains
from kvstream.hashing.base import (
    BlockHasher,
    ChainState,
    HashScope,
    PerBlock,
    id_scope,
    scope_bytes,
)
from kvstream.hashing.blocks import MixedBlock, Where, coerce_block, extra_ids_list, plain_raws
from kvstream.hashing.multimodal import NormMmKey, digest32, normalize_mm_keys

__all__ = ["STRUCTURED_CONTEXT", "Blake3Hasher"]

#: BLAKE3 key-derivation context of structured (multimodal / extra-id) blocks.
STRUCTURED_CONTEXT: Final = "kvstream.hashing.blake3 structured block v1"
_tuple_new = tuple.__new__


def _structured(
    parent: bytes, block: bytes | MixedBlock, keys: tuple[NormMmKey, ...], extra: Any
) -> bytes:
    if isinstance(block, MixedBlock):
        raw, digests = block.raw, block.digests
    else:
        raw, digests = block, ()
    n_int = len(raw) >> 2
    parts = [parent, n_int.to_bytes(4, "little"), raw, len(digests).to_bytes(4, "little")]
    for pos, d in digests:
        parts += (pos.to_bytes(4, "little"), d)
    parts.append(len(keys).to_bytes(4, "little"))
    for i, (h, off) in enumerate(keys):
        parts += (digest32(h, f"mm_keys[{i}]"), off.to_bytes(4, "little"))
    if extra is None:
        parts.append(b"\x00\x00\x00\x00")
    else:
        ids = extra_ids_list(extra, n_int)
        parts.append(len(ids).to_bytes(4, "little"))
        parts.extend(x.to_bytes(8, "little") for x in ids)
    return bytes(blake3(b"".join(parts), derive_key_context=STRUCTURED_CONTEXT).digest())


class Blake3Hasher(BlockHasher):
    """``blake3`` (``width=32``) / ``blake3_64`` (``width=8``): see the module docstring.

    ``native`` picks the whole-request C chain of plain blocks (:mod:`kvstream.hashing.accel`):
    None (default) when built, False never, True required.
    """

    _c_kind = KIND_BLAKE3
    _c_many = True

    def __init__(self, width: int = 32, *, native: bool | None = None) -> None:
        if width not in (8, 32):
            raise HashingError(f"blake3 publishes 32-byte keys or their first 8 bytes, not {width}")
        self.width = width
        self.name = "blake3" if width == 32 else "blake3_64"
        self._c: Any = native_chains(native, self.name)
        #: Whether chains of plain blocks run in C.
        self.native: bool = self._c is not None

    def _root(self, scope: HashScope) -> ChainState:
        """Root state: key = BLAKE3(scope bytes). LoRA is identified by ``lora_id``."""
        lora, salt = id_scope(self.name, scope, salt_hash="sha256")
        return ChainState(self.name, bytes(blake3(scope_bytes(lora, salt)).digest()), 0, ())

    def _key(self, parent: bytes, block: Any, mm_keys: Any, extra: Any, where: Where) -> bytes:
        raw = coerce_block(block, where)
        if not (raw.length if isinstance(raw, MixedBlock) else raw):
            raise HashingError("a block needs at least one token")
        keys = normalize_mm_keys(mm_keys)
        if type(raw) is bytes and not keys and extra is None:
            return bytes(blake3(parent + raw).digest())
        return _structured(parent, raw, keys, extra)

    def extend(
        self,
        state: ChainState,
        block_tokens: Any,
        mm_keys: Iterable[Any] | None = (),
        token_extra_ids: Any = None,
    ) -> tuple[bytes, ChainState]:
        """Hash one block (plain or structured form, see the module docstring)."""
        if type(state) is not ChainState or state.algo != self.name:
            self._check_state(state)
        if (
            type(block_tokens) is TokenIds
            and block_tokens._raw
            and not mm_keys
            and token_extra_ids is None
        ):
            key = blake3(state.key + block_tokens._raw).digest()
        else:
            key = self._key(state.key, block_tokens, mm_keys, token_extra_ids, "block_tokens")
        return (key if self.width == 32 else key[:8]), _tuple_new(
            ChainState, (self.name, key, state.depth + 1, ())
        )

    def _chain(
        self, state: ChainState, blocks: list[Any], mm: PerBlock, extra: PerBlock
    ) -> list[bytes]:
        key: bytes = state.key
        out: list[bytes] = []
        append = out.append
        key_of = self._key
        c = self._c
        if c is not None and mm is None and extra is None:
            raws = plain_raws(blocks)
            if raws is not None:
                published: list[bytes] = c.chain(KIND_BLAKE3, raws, 0, key, width=self.width)[0]
                return published
        if mm is None and extra is None:
            b3 = blake3
            for b in blocks:
                if type(b) is TokenIds and b._raw:
                    key = b3(key + b._raw).digest()
                else:
                    key = key_of(key, b, None, None, len(out))
                append(key)
        else:
            for i, b in enumerate(blocks):
                key = key_of(
                    key, b, None if mm is None else mm[i], None if extra is None else extra[i], i
                )
                append(key)
        if self.width == 8:
            return [k[:8] for k in out]
        return out

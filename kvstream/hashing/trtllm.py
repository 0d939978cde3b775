"""TensorRT-LLM block hashes: ``v1_block_key``, ``v2_sha256`` and ``v2_sha256_64``.

Request scope (all three): ``lora_id`` (LoRA task id, uint64) and a salt, given either as
``salt_id`` (uint64) or as a ``cache_salt`` string mapped to its id by the hasher's
``salt_hash`` derivation (:mod:`kvstream.hashing.salt`: ``"blake3"``, the default of
``v1_block_key``, as TensorRT-LLM's LLM API, V1 manager and router derive it; ``"sha256"``, the
default of ``v2_sha256``/``v2_sha256_64``, as the V2 manager does; ``"libstdcxx"``). TensorRT-LLM
identifies adapters by id only, so a ``lora_name`` without a ``lora_id`` raises HashingError.

``v1_block_key`` (V1 ``BlockKeyHasher``; 64-bit). All arithmetic mod 2**64 unless noted::

    mix32(v, s): v = token as uint32; twice v = ((v>>16)^v) * 0x045D9F3B mod 2**32;
                 v = (v>>16)^v; v = (v + 0x9E3779B9) mod 2**32;
                 return s ^ (v + (s<<6) + (s>>2))
    mix64(v, s): v = (v^(v>>30))*0xBF58476D1CE4E5B9; v = (v^(v>>27))*0x94D049BB133111EB;
                 v ^= v>>31; return s ^ (v + 0x9E3779B9 + (s<<6) + (s>>2))
    hash(block, parent):      (the root's parent is 0)
        s = len(tokens) ^ (parent * 0xBF58476D1CE4E5B9)
        if parent == 0 and salt: s = mix64(salt_id, s)
        for each token: s = mix32(token, s); with extra ids also s = mix64(extra_id, s)
        if lora_id is not None: s = mix64(lora_id, s)            (every block)
        for each mm key: s = mix32(w, s) for the 8 little-endian u32 words w of the digest,
                         then s = mix64(start_offset, s)          (V1 C++ only)
        return s

Published: the unsigned value, 8 bytes big-endian.

Two implementations give identical values. **Native** (the default when available): the C
extension :mod:`kvstream.hashing._v1native` (built by ``pip install`` when a C compiler is
present; optional) hashes a whole request in one call, faster than SHA-256 over the same bytes.
**Pure Python** (the reference, and the fallback when the extension is missing): every ``mix``
returns ``s ^ (w + (s<<6) + (s>>2))`` with a *seed-independent* ``w``; the ``w`` of a request's
tokens come from a lookup table (single blocks) or one numpy pass (long requests), so only the
seed recurrence runs per token in Python (~150 ns/token: ~10x less throughput than SHA-256).
Set the environment variable ``KVSTREAM_NO_NATIVE=1`` (any value but empty or ``0``) before
import to force the pure-Python path; ``V1BlockKeyHasher(native=False)`` picks it per hasher.

``v2_sha256`` (V2 radix key; 256-bit)::

    scope = one mask byte (bit0 lora present, bit1 salt present), then each present field as
            uint64 little-endian, lora first (no scope: b"\\x00")
    root  = SHA-256(scope)
    key   = SHA-256(parent_key (32 bytes) || each token as 4 bytes little-endian)

A 32-byte ``bytes`` element in a block is a multimodal *digest token* and enters the hashed
stream verbatim (TensorRT-LLM V2 puts the item's digest in place of its first token, item token
k as ``vocab_size + k``); pass blocks that way to reproduce a V2 engine's keys. ``mm_keys``
(a kvstream extension for engines that keep placeholder ids) are appended after the tokens,
each as ``digest (32 bytes) || start_offset as 4 bytes little-endian``.

``v2_sha256_64``: the first 8 key bytes (big-endian unsigned); chaining uses the full keys.

**Older V2 encodings** (``get_hasher("v2_sha256", encoding=...)``; the engine still publishes
``hash_algo`` ``v2_sha256``, so the encoding is a parameter of the algorithm, not a new name):

- ``"u32"`` (default): the encoding above (``_block_radix_tree.py`` @065ff9e9, whose ``Hasher``
  packs ids as 4 bytes to match the C++ backend's 4-byte ``TokenIdExt``);
- ``"u64"``: each int token as **8** bytes little-endian, the same scope root
  (``kv_cache_manager_v2/_cache_key.py`` @fa202e2a: ``array("Q", block)``);
- ``"u64_lora_root"``: 8-byte tokens and the root SHA-256 of the LoRA id as 8 bytes
  little-endian, or of nothing without one; no salt (``_block_radix_tree.py`` @27efb004: a salt
  raises HashingError).

Digest tokens are hashed verbatim in every encoding; ``mm_keys`` are appended as above.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import numpy as np

from kvstream._native import load as load_native
from kvstream._types import TokenIds
from kvstream.errors import HashingError
from kvstream.hashing.accel import KIND_V2, native_chains
from kvstream.hashing.base import (
    BlockHasher,
    ChainState,
    HashScope,
    PerBlock,
    id_scope,
    scope_bytes,
)
from kvstream.hashing.blocks import (
    MixedBlock,
    Where,
    coerce_block,
    coerce_many,
    coerce_tokens,
    extra_ids_list,
    plain_raws,
    u32_list,
)
from kvstream.hashing.multimodal import digest32, normalize_mm_keys
from kvstream.hashing.salt import check_salt_hash

if TYPE_CHECKING:  # typed by its stub; None at run time when not loaded
    from kvstream.hashing import _v1native
else:
    _v1native = load_native("kvstream.hashing._v1native")

__all__ = ["NATIVE_AVAILABLE", "V2_ENCODINGS", "V1BlockKeyHasher", "V2Sha256Hasher"]

#: Whether the v1_block_key C extension is loaded (``V1BlockKeyHasher``'s default path).
NATIVE_AVAILABLE: Final[bool] = _v1native is not None
_LITTLE: Final = sys.byteorder == "little"
#: The V2 key encodings :class:`V2Sha256Hasher` implements (see the module docstring).
V2_ENCODINGS: Final = ("u32", "u64", "u64_lora_root")
#: Per-block optional buffers (extra ids, mm records) passed to the C extension.
_Buffers: TypeAlias = list[bytes | None]

_M32: Final = 0xFFFFFFFF
_M64: Final = 0xFFFFFFFFFFFFFFFF
_K32: Final = 0x045D9F3B
_GOLD: Final = 0x9E3779B9
_SM1: Final = 0xBF58476D1CE4E5B9
_SM2: Final = 0x94D049BB133111EB
#: Below this many tokens the per-token w values come from a lookup table (numpy's per-call
#: overhead dominates for single blocks).
_NUMPY_MIN_TOKENS: Final = 64
_TABLE_SIZE: Final = 1 << 18
_W32_TABLE: array[int] | None = None
_sha256 = hashlib.sha256
_tuple_new = tuple.__new__


def _w32(v: int) -> int:
    """The seed-independent term of mix32 for one token."""
    v = (((v >> 16) ^ v) * _K32) & _M32
    v = (((v >> 16) ^ v) * _K32) & _M32
    v = (v >> 16) ^ v
    return (v + _GOLD) & _M32


def _w64(v: int) -> int:
    """The seed-independent term of mix64 (splitmix64 finalizer plus the golden constant)."""
    v = ((v ^ (v >> 30)) * _SM1) & _M64
    v = ((v ^ (v >> 27)) * _SM2) & _M64
    v ^= v >> 31
    return (v + _GOLD) & _M64


def _w32_np(v: np.ndarray[Any, np.dtype[np.uint32]]) -> np.ndarray[Any, np.dtype[np.uint32]]:
    """mix32 terms of a uint32 array (a new array; uint32 arithmetic wraps mod 2**32)."""
    v = v.astype(np.uint32)
    k = np.uint32(_K32)
    v ^= v >> 16
    v *= k
    v ^= v >> 16
    v *= k
    v ^= v >> 16
    v += np.uint32(_GOLD)
    return v


def _w32_table() -> array[int]:
    """mix32 terms of the ids below ``_TABLE_SIZE`` (built on first use: ~1 MiB, a few ms)."""
    global _W32_TABLE  # noqa: PLW0603  (published by one atomic rebinding: thread-safe)
    table = _W32_TABLE
    if table is None:
        table = array("I", _w32_np(np.arange(_TABLE_SIZE, dtype=np.uint32)).tobytes())
        _W32_TABLE = table
    return table


def _w32_all(raw: bytes) -> list[int]:
    """mix32 terms of every u32 little-endian token in ``raw``.

    Short blocks look the terms up in a table (vocabulary ids are below 2**18); long requests
    compute them with numpy in one pass.
    """
    if len(raw) < 4 * _NUMPY_MIN_TOKENS:
        toks = u32_list(raw)
        try:
            return list(map(_w32_table().__getitem__, toks))
        except IndexError:  # an id >= _TABLE_SIZE
            return [_w32(t) for t in toks]
    out: list[int] = _w32_np(np.frombuffer(raw, dtype="<u4")).tolist()
    return out


def _w64_all(values: list[int]) -> list[int]:
    """mix64 terms of every value (uint64), vectorised for long lists."""
    if len(values) < _NUMPY_MIN_TOKENS:
        return [_w64(x) for x in values]
    v = np.array(values, dtype=np.uint64)
    v ^= v >> np.uint64(30)
    v *= np.uint64(_SM1)
    v ^= v >> np.uint64(27)
    v *= np.uint64(_SM2)
    v ^= v >> np.uint64(31)
    v += np.uint64(_GOLD)
    out: list[int] = v.tolist()
    return out


def _u64_bytes(values: list[int]) -> bytes:
    """Validated uint64 values as little-endian bytes (the C extension's extra-id buffer)."""
    arr = array("Q", values)
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def _mm_records(mm_keys: Iterable[Any] | None) -> bytes | None:
    """A block's mm keys as the C extension's records: digest (32) || start_offset (u32 LE)."""
    parts: list[bytes] = []
    for i, (h, off) in enumerate(normalize_mm_keys(mm_keys)):
        parts.append(digest32(h, f"mm_keys[{i}]"))
        parts.append(off.to_bytes(4, "little"))
    return b"".join(parts) if parts else None


def _mm_terms(mm_keys: Iterable[Any] | None) -> list[int]:
    terms: list[int] = []
    for i, (h, off) in enumerate(normalize_mm_keys(mm_keys)):
        d = digest32(h, f"mm_keys[{i}]")
        terms.extend(_w32(w) for w in u32_list(d))
        terms.append(_w64(off))
    return terms


class V1BlockKeyHasher(BlockHasher):
    """``v1_block_key``: TensorRT-LLM V1 ``BlockKeyHasher`` (64-bit; see module docstring).

    Supports salt, LoRA id, per-token extra ids and multimodal keys. Chain values are the
    unsigned 64-bit ints TensorRT-LLM publishes in JSON. ``native`` picks the implementation:
    None (default) the C extension when :data:`NATIVE_AVAILABLE`, False the pure-Python
    reference, True the C extension (HashingError when it is not available). ``salt_hash``
    maps ``cache_salt`` strings to salt ids (:mod:`kvstream.hashing.salt`; default
    ``"blake3"``).
    """

    name = "v1_block_key"
    width = 8

    def __init__(self, *, native: bool | None = None, salt_hash: str = "blake3") -> None:
        self.salt_hash: str = check_salt_hash(salt_hash)
        if native is None:
            native = NATIVE_AVAILABLE
        elif native and not NATIVE_AVAILABLE:
            raise HashingError(
                "the v1_block_key C extension is not available (not built, or "
                "KVSTREAM_NO_NATIVE is set)"
            )
        self.native: bool = bool(native)

    def _root(self, scope: HashScope) -> ChainState:
        """Root state; the parent of the first block is 0.

        The scope is ``(salt term, lora term, salt_id, lora_id)`` (terms for the Python path,
        ids for the C one); either implementation extends the other's states.
        """
        lora, salt = id_scope(self.name, scope, salt_hash=self.salt_hash)
        return ChainState(
            self.name,
            0,
            0,
            (
                None if salt is None else _w64(salt),
                None if lora is None else _w64(lora),
                salt,
                lora,
            ),
        )

    @staticmethod
    def _hash(
        parent: int, n: int, terms: list[int], scope: tuple[Any, ...], tail: list[int]
    ) -> int:
        salt_w, lora_w = scope[0], scope[1]
        s = (n ^ (parent * _SM1)) & _M64
        if parent == 0 and salt_w is not None:
            s = (s ^ (salt_w + (s << 6) + (s >> 2))) & _M64
        for w in terms:
            s = (s ^ (w + (s << 6) + (s >> 2))) & _M64
        if lora_w is not None:
            s = (s ^ (lora_w + (s << 6) + (s >> 2))) & _M64
        for w in tail:
            s = (s ^ (w + (s << 6) + (s >> 2))) & _M64
        return s

    def _extend_int(
        self, state: ChainState, block_tokens: Any, mm_keys: Any, token_extra_ids: Any
    ) -> int:
        raw = coerce_tokens(block_tokens)
        n = len(raw) >> 2
        if n == 0:
            raise HashingError("a block needs at least one token")
        terms = _w32_all(raw)
        if token_extra_ids is not None:
            extra = _w64_all(extra_ids_list(token_extra_ids, n))
            terms = [w for pair in zip(terms, extra, strict=True) for w in pair]
        return self._hash(state.key, n, terms, state.scope, _mm_terms(mm_keys))

    @staticmethod
    def _extend_native(
        state: ChainState, block_tokens: Any, mm_keys: Any, token_extra_ids: Any
    ) -> int:
        raw = block_tokens._raw if type(block_tokens) is TokenIds else coerce_tokens(block_tokens)
        if not raw:
            raise HashingError("a block needs at least one token")
        scope = state.scope
        if not mm_keys and token_extra_ids is None:
            return _v1native.block_key(raw, state.key, scope[2], scope[3])
        extra = None
        if token_extra_ids is not None:
            extra = _u64_bytes(extra_ids_list(token_extra_ids, len(raw) >> 2))
        return _v1native.block_key(raw, state.key, scope[2], scope[3], extra, _mm_records(mm_keys))

    @staticmethod
    def _native_args(
        state: ChainState, blocks: list[Any], mm: PerBlock, extra: PerBlock
    ) -> tuple[list[bytes], None, int, int | None, int | None, _Buffers | None, _Buffers | None]:
        """The C extension's chain arguments for ``blocks`` after ``state``.

        (per-block token buffers, block sizes (None), parent, salt_id, lora_id, extra-id
        buffers, mm records).
        """
        raws = coerce_many(blocks)
        extra_bufs: _Buffers | None = None
        if extra is not None:
            extra_bufs = [
                None if e is None else _u64_bytes(extra_ids_list(e, len(raw) >> 2))
                for raw, e in zip(raws, extra, strict=True)
            ]
        mm_bufs: _Buffers | None = None if mm is None else [_mm_records(m) for m in mm]
        scope = state.scope
        return raws, None, state.key, scope[2], scope[3], extra_bufs, mm_bufs

    def extend(
        self,
        state: ChainState,
        block_tokens: Any,
        mm_keys: Iterable[Any] | None = (),
        token_extra_ids: Any = None,
    ) -> tuple[bytes, ChainState]:
        """Hash one block; the published hash is the 64-bit value, 8 bytes big-endian."""
        if type(state) is not ChainState or state.algo != self.name:
            self._check_state(state)
        if self.native:
            if (
                type(block_tokens) is TokenIds
                and block_tokens._raw
                and not mm_keys
                and token_extra_ids is None
            ):  # the hot case, inlined
                scope = state.scope
                key = _v1native.block_key(block_tokens._raw, state.key, scope[2], scope[3])
            else:
                key = self._extend_native(state, block_tokens, mm_keys, token_extra_ids)
        else:
            key = self._extend_int(state, block_tokens, mm_keys, token_extra_ids)
        return key.to_bytes(8, "big"), _tuple_new(
            ChainState, (self.name, key, state.depth + 1, state.scope)
        )

    def _chain_json(
        self, state: ChainState, blocks: list[Any], mm: PerBlock, extra: PerBlock
    ) -> list[int]:
        """The chain as unsigned 64-bit ints (the JSON form of :meth:`BlockHasher.chain`),
        computed as ints (both implementations produce them), not converted from bytes."""
        return self._ints(state, blocks, mm, extra)

    def _chain(
        self, state: ChainState, blocks: list[Any], mm: PerBlock, extra: PerBlock
    ) -> list[bytes]:
        if self.native:
            return _v1native.chain_bytes(*self._native_args(state, blocks, mm, extra))
        return [k.to_bytes(8, "big") for k in self._ints(state, blocks, mm, extra)]

    def _chain_raw(
        self, state: ChainState, raw: bytes, tokens_per_block: int, start: int, every: int
    ) -> tuple[list[bytes], list[Any]]:
        """See :meth:`BlockHasher.chain_raw`; the v1 C extension hashes the flat buffer."""
        if not self.native:
            return super()._chain_raw(state, raw, tokens_per_block, start, every)
        self._check_state(state)
        step = 4 * tokens_per_block
        end = len(raw) // step * step
        if start * step >= end:
            return [], []
        scope = state.scope
        out: list[bytes] = _v1native.chain_bytes(
            raw[start * step : end], tokens_per_block, state.key, scope[2], scope[3]
        )
        keys: list[Any] = []
        if every > 0:
            first = -(start + 1) % every  # out index of the first block with (i+1) % every == 0
            keys = [int.from_bytes(k, "big") for k in out[first::every]]
        return out, keys

    def _ints(
        self, state: ChainState, blocks: list[Any], mm: PerBlock, extra: PerBlock
    ) -> list[int]:
        """Like :meth:`_chain`, the values as ints."""
        if self.native:
            return _v1native.chain(*self._native_args(state, blocks, mm, extra))
        if mm is not None or extra is not None:
            return [int.from_bytes(b, "big") for b in super()._chain(state, blocks, mm, extra)]
        # Fast path: the w terms of every token of the request in one numpy pass.
        raws = coerce_many(blocks)
        terms = _w32_all(b"".join(raws))
        scope = state.scope
        key: int = state.key
        pos = 0
        hash_ = self._hash
        out: list[int] = []
        for raw in raws:
            n = len(raw) >> 2
            key = hash_(key, n, terms[pos : pos + n], scope, [])
            pos += n
            out.append(key)
        return out


def _widen(block: bytes | MixedBlock) -> bytes:
    """A coerced block in the 8-byte token encoding: ids as u64 LE, digest tokens verbatim."""
    if isinstance(block, MixedBlock):
        ints = iter(u32_list(block.raw))
        digests = dict(block.digests)
        parts = [
            digests[i] if i in digests else next(ints).to_bytes(8, "little")
            for i in range(block.length)
        ]
        return b"".join(parts)
    wide = array("Q", u32_list(block))
    if not _LITTLE:  # pragma: no cover
        wide.byteswap()
    return wide.tobytes()


class V2Sha256Hasher(BlockHasher):
    """``v2_sha256`` (``width=32``) and ``v2_sha256_64`` (``width=8``): TensorRT-LLM V2 keys.

    See the module docstring for the key definition, digest tokens, ``mm_keys`` and the
    ``encoding`` values (:data:`V2_ENCODINGS`; default ``"u32"``). ``salt_hash`` maps
    ``cache_salt`` strings to salt ids (:mod:`kvstream.hashing.salt`; default ``"sha256"``, the
    V2 manager's derivation). Per-token extra ids are not part of V2 keys and raise
    HashingError. ``native`` picks the whole-request C chain of the ``u32`` encoding
    (:mod:`kvstream.hashing.accel`): None (default) when built, False never, True required.
    """

    _no_extra_ids = "v2_sha256 keys do not include per-token extra ids"
    _c_kind = KIND_V2

    def __init__(
        self,
        width: int = 32,
        *,
        salt_hash: str = "sha256",
        encoding: str = "u32",
        native: bool | None = None,
    ) -> None:
        if width not in (8, 32):
            raise HashingError(
                f"v2_sha256 publishes 32-byte keys or their first 8 bytes, not {width}"
            )
        if encoding not in V2_ENCODINGS:
            raise HashingError(
                f"encoding must be one of {', '.join(V2_ENCODINGS)}; got {encoding!r}"
            )
        self.width = width
        self.name = "v2_sha256" if width == 32 else "v2_sha256_64"
        self.salt_hash: str = check_salt_hash(salt_hash)
        self.encoding: str = encoding
        self._wide = encoding != "u32"
        # The C chains (kvstream.hashing.accel) cover the u32 encoding of plain int blocks.
        self._c: Any = None if self._wide else native_chains(native, self.name)
        #: Whether whole-request chains run in C (``native``: None = when built, False = never,
        #: True = required).
        self.native: bool = self._c is not None

    def _root(self, scope: HashScope) -> ChainState:
        """Root state: key = SHA-256(scope bytes) (``u64_lora_root``: of the LoRA id alone)."""
        lora, salt = id_scope(self.name, scope, salt_hash=self.salt_hash)
        if self.encoding == "u64_lora_root":
            if salt is not None:
                raise HashingError(
                    "the u64_lora_root V2 encoding (TensorRT-LLM @27efb004) has no cache salt"
                )
            encoded = b"" if lora is None else lora.to_bytes(8, "little")
        else:
            encoded = scope_bytes(lora, salt)
        return ChainState(self.name, hashlib.sha256(encoded).digest(), 0, ())

    def _message(
        self, block_tokens: Any, mm_keys: Any, token_extra_ids: Any, where: Where
    ) -> bytes:
        if token_extra_ids is not None:
            raise HashingError(self._no_extra_ids)
        coerced = coerce_block(block_tokens, where)
        if self._wide:
            raw = _widen(coerced)
        else:
            raw = coerced.verbatim if isinstance(coerced, MixedBlock) else coerced
        if not raw:
            raise HashingError("a block needs at least one token")
        if mm_keys:
            parts = [raw]
            for i, (h, off) in enumerate(normalize_mm_keys(mm_keys)):
                parts.append(digest32(h, f"mm_keys[{i}]"))
                parts.append(off.to_bytes(4, "little"))
            raw = b"".join(parts)
        return raw

    def extend(
        self,
        state: ChainState,
        block_tokens: Any,
        mm_keys: Iterable[Any] | None = (),
        token_extra_ids: Any = None,
    ) -> tuple[bytes, ChainState]:
        """Hash one block: key = SHA-256(parent key || block stream)."""
        if type(state) is not ChainState or state.algo != self.name:
            self._check_state(state)
        if (
            type(block_tokens) is TokenIds
            and not mm_keys
            and token_extra_ids is None
            and not self._wide
        ):
            msg = block_tokens._raw
        else:
            msg = self._message(block_tokens, mm_keys, token_extra_ids, "block_tokens")
        if not msg:
            raise HashingError("a block needs at least one token")
        key = _sha256(state.key + msg).digest()
        return (key if self.width == 32 else key[:8]), _tuple_new(
            ChainState, (self.name, key, state.depth + 1, ())
        )

    def _chain(
        self, state: ChainState, blocks: list[Any], mm: PerBlock, extra: PerBlock
    ) -> list[bytes]:
        c = self._c
        if c is not None and mm is None:
            raws = plain_raws(blocks)
            if raws is not None:
                published: list[bytes] = c.chain(KIND_V2, raws, 0, state.key, width=self.width)[0]
                return published
        key: bytes = state.key
        sha = hashlib.sha256
        out: list[bytes] = []
        append = out.append
        message = self._message
        if mm is None and not self._wide:
            # Hot loop: TokenIds blocks hash their packed bytes directly.
            for b in blocks:
                if type(b) is TokenIds:
                    msg = b._raw
                    if not msg:
                        raise HashingError(f"blocks[{len(out)}]: a block needs at least one token")
                else:
                    msg = message(b, None, None, len(out))
                key = sha(key + msg).digest()
                append(key)
        else:
            for i, b in enumerate(blocks):
                key = sha(key + message(b, None if mm is None else mm[i], None, i)).digest()
                append(key)
        if self.width == 8:
            return [k[:8] for k in out]
        return out

"""vLLM prefix-cache block hashes: the request scope they share, and ``vllm_sha256_cbor(_64)``.

vLLM (>= 0.29; checked against 0.33's ``vllm/v1/core/kv_cache_utils.py`` and
``vllm/utils/hashing.py``) hashes each full block as::

    NONE_HASH  = H(seed)                          seed: a str
    hash(blk)  = H((parent_digest, tuple(tokens), extra_keys_or_None))
                 first block's parent = NONE_HASH

where ``H`` is the engine's ``prefix_caching_hash_algo``: ``sha256`` (the default: SHA-256 of
``pickle.dumps(x, protocol=5)``, :mod:`kvstream.hashing.vllm_pickle`) or ``sha256_cbor``
(SHA-256 of ``cbor2.dumps(x, canonical=True)``, this module). Both publish the 32-byte digest
(``vllm_sha256``, ``vllm_sha256_cbor``) or, with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the
default, its **last** 8 bytes big-endian (``vllm_sha256_64``, ``vllm_sha256_cbor_64``).

**Seed.** vLLM uses ``"vllm-none-hash"`` unless ``PYTHONHASHSEED`` is set in the engine's
environment, in which case that string is the seed. kvstream never reads the environment:
pass the engine's value explicitly, ``get_hasher("vllm_sha256", seed="0")``.

**Extra keys** of a block (``generate_block_hash_extra_keys``), a tuple in this order, or None
when empty (``extra_keys="tagged"``, vLLM >= 0.31, the default)::

    ("lora", lora_name, lora_path)        every block, when the request has a LoRA adapter
    ("mm", identifier, offset)            each multimodal item overlapping the block, in order
    ("cache_salt", salt)                  first block only, when the salt is non-empty
    ("prompt_embeds", digest)             every block of a prompt-embeds request

``extra_keys="legacy"`` (vLLM 0.24-0.30) uses the untagged forms ``lora_name``,
``(identifier, offset)``, ``salt`` and ``digest``.

- **Multimodal** (``mm_keys``): ``(identifier, offset)`` per item, as vLLM computes them:
  ``identifier`` is ``mm_feature.identifier``, a str hashed as given (bytes are taken as a
  content digest and hashed as their lowercase hex); ``offset`` is the item's first token
  position **minus the block's first token position**, so it is negative for an item that
  started in an earlier block (e.g. a 10-token image at position 2 with 4-token blocks gives
  offsets 2, -2, -6). These are exactly the ``(identifier, offset)`` pairs vLLM publishes in
  ``BlockStored.extra_keys``.
- **LoRA**: vLLM >= 0.31 hashes the adapter's ``lora_path`` as well as its name (vLLM 0.33's
  ``LoRARequest`` asserts that the path is non-empty, so there is no name-only form). The path
  is not published in events: pass it with ``root(lora_path=...)`` or map names to paths once
  with the hasher's ``lora_paths`` (the ``--lora-modules name=path`` of the engine); a
  ``lora_name`` whose path is unknown raises HashingError rather than hashing a guess. A
  ``lora_id`` without a ``lora_name`` raises too (vLLM identifies adapters by name).
- **Salt**: a string; the empty string is no salt (vLLM tests ``request.cache_salt`` for
  truth). ``salt_id`` raises.
- **Prompt embeds** (``prompt_embeds=``, keyword-only on ``extend``/``chain``/``chain_bytes``):
  per block, the 32-byte SHA-256 of the block's slice of the request's ``prompt_embeds`` tensor
  as raw bytes (:func:`prompt_embeds_digest`).

Per-token extra ids and digest tokens do not exist in vLLM and raise HashingError. Lookahead
(EAGLE) keys are not modelled.
"""

from __future__ import annotations

import hashlib
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, Final, TypeVar

import numpy as np

from kvstream.errors import HashingError
from kvstream.hashing import cbor
from kvstream.hashing.accel import KIND_CBOR, native_chains
from kvstream.hashing.base import BlockHasher, ChainState, HashScope, PerBlock, name_scope
from kvstream.hashing.blocks import coerce_many, coerce_tokens, u32_list
from kvstream.hashing.multimodal import normalize_mm_keys

__all__ = [
    "DEFAULT_SEED",
    "VllmHasherBase",
    "VllmSha256CborHasher",
    "prompt_embeds_digest",
]

DEFAULT_SEED: Final = "vllm-none-hash"
_PARENT_HEAD: Final = b"\x83\x58\x20"  # array(3), then bytes(32)
_NONE: Final = b"\xf6"
#: The request scope (LoRA key, salt key) of a request with neither: no extra keys.
_NO_SCOPE: Final = (None, None)
#: Requests with at least this many tokens have their token arrays encoded by numpy at once.
_VECTOR_MIN_TOKENS: Final = 512
_DIGEST_LEN: Final = 32
_tuple_new = tuple.__new__
_T = TypeVar("_T")


def prompt_embeds_digest(embeds: Any) -> bytes:
    """The digest vLLM hashes for a block's prompt embeddings: SHA-256 of their raw bytes.

    ``embeds`` is the block's slice (``prompt_embeds[start:end]``) as a numpy array (made
    C-contiguous, in its own dtype) or any bytes-like object holding the tensor's bytes, which
    is what vLLM hashes (``tensor.flatten().contiguous().view(torch.uint8)``).
    """
    if isinstance(embeds, np.ndarray):
        data: bytes = np.ascontiguousarray(embeds).tobytes()
    elif isinstance(embeds, (bytes, bytearray, memoryview)):
        data = bytes(embeds)
    else:
        raise HashingError(
            f"prompt embeds must be a numpy array or bytes, got {type(embeds).__name__}"
        )
    return hashlib.sha256(data).digest()


def _embeds_list(prompt_embeds: Sequence[Any] | None, n_blocks: int) -> list[Any] | None:
    if prompt_embeds is None:
        return None
    out = list(prompt_embeds)
    if len(out) != n_blocks:
        raise HashingError(
            f"prompt_embeds needs one digest per block: got {len(out)} for {n_blocks} blocks"
        )
    return out


class VllmHasherBase(BlockHasher):
    """What vLLM's hash algorithms share: the seed, the request scope and the extra keys.

    Parameters: ``width`` (32: the digest; 8: its last 8 bytes), ``seed`` (the NONE_HASH seed
    string), ``extra_keys`` (``"tagged"`` or ``"legacy"``), ``lora_paths`` (adapter name ->
    path, for the tagged LoRA key), ``native`` (the C chain of the subclass's ``_c_kind``:
    None = when built, False = never, True = required). Subclasses define :attr:`algo` and
    :meth:`hash_object`;
    everything else (root, extra keys, ``extend``, ``chain_bytes``) is shared.
    """

    #: The 256-bit algorithm name; the 64-bit one appends ``_64``.
    algo: ClassVar[str]
    _no_extra_ids = "vLLM block hashes have no per-token extra ids"

    def __init__(
        self,
        width: int = 32,
        *,
        seed: str = DEFAULT_SEED,
        extra_keys: str = "tagged",
        lora_paths: Mapping[str, str] | None = None,
        native: bool | None = None,
    ) -> None:
        if width not in (8, 32):
            raise HashingError(f"{self.algo} publishes 32 or 8 bytes, not {width}")
        if not isinstance(seed, str):
            raise HashingError(
                f"seed must be a str (vLLM hashes PYTHONHASHSEED as a string), got {seed!r}"
            )
        if extra_keys not in ("tagged", "legacy"):
            raise HashingError(f"extra_keys must be 'tagged' or 'legacy', got {extra_keys!r}")
        paths = dict(lora_paths or {})
        for name, path in paths.items():
            if not isinstance(name, str) or not isinstance(path, str):
                raise HashingError(
                    f"lora_paths maps str names to str paths; got {name!r}: {path!r}"
                )
        self.width = width
        self.name = self.algo if width == 32 else self.algo + "_64"
        self.seed = seed
        self.extra_keys = extra_keys
        self.lora_paths: Mapping[str, str] = MappingProxyType(paths)
        self._tagged = extra_keys == "tagged"
        #: vLLM's NONE_HASH: the parent digest of a request's first block.
        self.none_hash: bytes = self.hash_object(seed)
        self._c: Any = native_chains(native, self.name) if self._c_kind >= 0 else None
        #: Whether chains of blocks without per-block keys (multimodal, prompt embeds) run in
        #: C (``native``: None = when built, False = never, True = required).
        self.native: bool = self._c is not None

    @abstractmethod
    def hash_object(self, obj: Any) -> bytes:
        """``H(obj)``: the 32-byte digest of a hash input, as the engine computes it.

        The one hook a vLLM algorithm must define: NONE_HASH and, by default, every block's
        digest (:meth:`_digest`, :meth:`_digests`) are ``H`` of vLLM's Python objects.
        """

    @staticmethod
    def _str(value: str) -> str:
        """Hook: the str object to place in a hash input (the pickle variant copies it)."""
        return value

    def _digest(self, parent: bytes, raw: bytes, keys: list[Any]) -> bytes:
        """Hook: one block's digest, ``H((parent, tuple(tokens), tuple(keys) or None))``.

        ``raw`` is the block's tokens as u32 little-endian bytes, ``keys`` its extra keys
        (:meth:`_keys`). Overridden where the engine's encoding can be built faster.
        """
        return self.hash_object((parent, tuple(u32_list(raw)), _as_tuple(keys)))

    def _digests(
        self, state: ChainState, raws: list[bytes], mm: PerBlock, embeds: PerBlock
    ) -> list[bytes]:
        """Hook: the digests of a request's blocks (``raws``) chained after the root ``state``.

        ``mm``/``embeds``: one entry per block, or None. Equals chaining :meth:`_digest`; this
        default applies :meth:`hash_object` directly, so a subclass that overrides one of the
        two for speed overrides both.
        """
        hash_object = self.hash_object
        parent: bytes = state.key
        out: list[bytes] = []
        extras = self._block_extras(
            state.scope, len(raws), mm, embeds, _as_tuple, first=state.depth == 0
        )
        for raw, extra in zip(raws, extras, strict=True):
            parent = hash_object((parent, tuple(u32_list(raw)), extra))
            out.append(parent)
        return out

    def _block_extras(
        self,
        scope: tuple[Any, ...],
        n: int,
        mm: PerBlock,
        embeds: PerBlock,
        encode: Callable[[list[Any]], _T],
        *,
        first: bool = True,
    ) -> list[_T]:
        """``encode`` of the extra keys (:meth:`_keys`) of each of ``n`` consecutive blocks.

        ``first``: whether the first of them is the request's first block (chain depth 0).
        Without per-block keys every block but the first has the same keys: encoded once.
        """
        keys = self._keys
        if mm is None and embeds is None:
            if n == 0:
                return []
            rest = encode(keys(scope, False, None, None))
            return [encode(keys(scope, first, None, None))] + [rest] * (n - 1)
        return [
            encode(
                keys(
                    scope,
                    first and i == 0,
                    None if mm is None else mm[i],
                    None if embeds is None else embeds[i],
                )
            )
            for i in range(n)
        ]

    def _root(self, scope: HashScope) -> ChainState:
        """Root state: parent NONE_HASH; the LoRA and salt extra keys of the request."""
        name_scope(
            self.name,
            scope,
            no_salt_id="vLLM hashes the cache_salt string; a numeric salt_id cannot be mixed in",
        )
        s = self._str
        lora_name, cache_salt = scope.lora_name, scope.cache_salt
        lora_key: Any = None
        if lora_name is not None:
            if self._tagged:
                path = (
                    scope.lora_path
                    if scope.lora_path is not None
                    else self.lora_paths.get(lora_name)
                )
                if not isinstance(path, str):
                    raise HashingError(
                        f"vLLM >= 0.31 hashes ('lora', name, path) and never a name alone: pass "
                        f"the path of adapter {lora_name!r} (root(lora_path=...) or lora_paths=)"
                    )
                lora_key = ("lora", s(lora_name), s(path))
            else:
                lora_key = s(lora_name)
        salt_key: Any = None
        if cache_salt:  # vLLM skips an empty salt
            salt_key = ("cache_salt", s(cache_salt)) if self._tagged else s(cache_salt)
        return ChainState(self.name, self.none_hash, 0, (lora_key, salt_key))

    def _keys(
        self, scope: tuple[Any, ...], first: bool, mm_keys: Any, prompt_embeds: Any
    ) -> list[Any]:
        """The block's extra keys in vLLM's order (empty list: None)."""
        lora_key, salt_key = scope
        keys: list[Any] = []
        if lora_key is not None:
            keys.append(lora_key)
        if mm_keys:
            s = self._str
            for h, off in normalize_mm_keys(mm_keys, signed_offsets=True):
                ident = s(h) if isinstance(h, str) else bytes(h).hex()
                keys.append(("mm", ident, off) if self._tagged else (ident, off))
        if first and salt_key is not None:
            keys.append(salt_key)
        if prompt_embeds is not None:
            if (
                not isinstance(prompt_embeds, (bytes, bytearray))
                or len(prompt_embeds) != _DIGEST_LEN
            ):
                raise HashingError(
                    "prompt_embeds takes each block's 32-byte SHA-256 digest "
                    "(see prompt_embeds_digest)"
                )
            digest = bytes(prompt_embeds)
            keys.append(("prompt_embeds", digest) if self._tagged else digest)
        return keys

    def extend(
        self,
        state: ChainState,
        block_tokens: Any,
        mm_keys: Iterable[Any] | None = (),
        token_extra_ids: Any = None,
        *,
        prompt_embeds: bytes | None = None,
    ) -> tuple[bytes, ChainState]:
        """Hash one block: ``H((parent, tokens, extra_keys))``; ``prompt_embeds``: its digest."""
        if type(state) is not ChainState or state.algo != self.name:
            self._check_state(state)
        if token_extra_ids is not None:
            raise HashingError(self._no_extra_ids)
        raw = coerce_tokens(block_tokens, "block_tokens")
        if not raw:
            raise HashingError("a block needs at least one token")
        keys = self._keys(state.scope, state.depth == 0, mm_keys, prompt_embeds)
        digest = self._digest(state.key, raw, keys)
        published = digest if self.width == 32 else digest[-8:]
        return published, _tuple_new(ChainState, (self.name, digest, state.depth + 1, state.scope))

    def _chain(
        self, state: ChainState, blocks: list[Any], mm: PerBlock, extra: PerBlock
    ) -> list[bytes]:
        digests = self._digests(state, coerce_many(blocks), mm, None)
        return digests if self.width == 32 else [d[-8:] for d in digests]

    def _chain_embeds(
        self,
        state: ChainState,
        blocks: list[Any],
        mm: PerBlock,
        extra: PerBlock,
        prompt_embeds: Sequence[bytes | None],
    ) -> list[bytes]:
        """The chain with ``prompt_embeds``: one digest per block (see
        :func:`prompt_embeds_digest`)."""
        embeds = _embeds_list(prompt_embeds, len(blocks))
        digests = self._digests(state, coerce_many(blocks), mm, embeds)
        return digests if self.width == 32 else [d[-8:] for d in digests]

    def _chain_raw(
        self, state: ChainState, raw: bytes, tokens_per_block: int, start: int, every: int
    ) -> tuple[list[bytes], list[Any]]:
        """See :meth:`BlockHasher.chain_raw` (the chain keys are the block digests)."""
        self._check_state(state)
        step = 4 * tokens_per_block
        raws = [raw[i * step : (i + 1) * step] for i in range(start, len(raw) // step)]
        if not raws:
            return [], []
        digests = self._digests(state, raws, None, None)
        keys = digests[-(start + 1) % every :: every] if every > 0 else []
        return (digests if self.width == 32 else [d[-8:] for d in digests]), keys


class VllmSha256CborHasher(VllmHasherBase):
    """vLLM's ``sha256_cbor`` prefix hash (``width`` 32) or its published u64 form (8).

    See the module docstring; ``H`` = SHA-256 of canonical CBOR (:mod:`kvstream.hashing.cbor`).
    The block digests are built from byte-level CBOR (the payload's parent and token array
    encoded directly, the extra keys once per request where they repeat).
    """

    algo = "vllm_sha256_cbor"
    _c_kind = KIND_CBOR

    def _tails(self, state: ChainState) -> tuple[bytes | None, bytes | None]:
        """CBOR extra keys of the block after ``state`` and of the rest (None: ``f6``, no
        keys; the first also None when it has the rest's)."""
        scope = state.scope
        if scope == _NO_SCOPE:
            return None, None
        rest = _cbor_keys(self._keys(scope, False, None, None))
        first = _cbor_keys(self._keys(scope, True, None, None)) if state.depth == 0 else None
        return first, rest

    def _c_args(
        self, state: ChainState, tokens_per_block: int
    ) -> tuple[bytes, int, bytes | None, bytes | None]:
        # the 64-bit form publishes the digest's last 8 bytes
        return (state.key, 32 - self.width, *self._tails(state))

    def hash_object(self, obj: Any) -> bytes:
        return hashlib.sha256(cbor.dumps(obj)).digest()

    def _digest(self, parent: bytes, raw: bytes, keys: list[Any]) -> bytes:
        tail = cbor.dumps(tuple(keys)) if keys else _NONE
        return hashlib.sha256(
            b"".join((_PARENT_HEAD, parent, cbor.token_array(raw), tail))
        ).digest()

    def _digests(
        self, state: ChainState, raws: list[bytes], mm: PerBlock, embeds: PerBlock
    ) -> list[bytes]:
        c = self._c
        if c is not None and mm is None and embeds is None:
            first, rest = self._tails(state)
            digests: list[bytes] = c.chain(KIND_CBOR, raws, 0, state.key, 0, 32, 0, first, rest)[0]
            return digests
        tails = self._block_extras(
            state.scope, len(raws), mm, embeds, _cbor_keys, first=state.depth == 0
        )
        # Fast path: every block's "tokens + extra keys" segment built at once, so the loop
        # only concatenates the parent and hashes.
        lengths = [len(r) >> 2 for r in raws]
        if sum(lengths) >= _VECTOR_MIN_TOKENS:
            segments = cbor.token_arrays(b"".join(raws), lengths, none_tail=True)
            _set_tails(segments, tails)
        else:
            segments = [cbor.token_array(r) + tail for r, tail in zip(raws, tails, strict=True)]
        return _sha_chain(state.key, segments)

    def _chain_raw(
        self, state: ChainState, raw: bytes, tokens_per_block: int, start: int, every: int
    ) -> tuple[list[bytes], list[Any]]:
        # The pure-Python path of chain_raw: equal blocks, so their CBOR token arrays come
        # from one numpy pass over ``raw`` (no per-block slices) when there are enough.
        if not 0 < tokens_per_block < 1 << 32:
            return super()._chain_raw(state, raw, tokens_per_block, start, every)
        step = 4 * tokens_per_block
        n = len(raw) // step - start
        if n * tokens_per_block < _VECTOR_MIN_TOKENS:
            return super()._chain_raw(state, raw, tokens_per_block, start, every)
        self._check_state(state)
        segments = cbor.block_arrays(raw[start * step : (start + n) * step], tokens_per_block)
        tails = self._block_extras(state.scope, n, None, None, _cbor_keys, first=state.depth == 0)
        if tails[0] != _NONE or tails[-1] != _NONE:  # [first] + [rest] * (n - 1)
            _set_tails(segments, tails)
        digests = _sha_chain(state.key, segments)
        keys = digests[-(start + 1) % every :: every] if every > 0 else []
        return (digests if self.width == 32 else [d[-8:] for d in digests]), keys


def _set_tails(segments: list[bytes], tails: list[bytes]) -> None:
    """Replace the ``f6`` (no extra keys) that ends each CBOR segment by its block's tail."""
    for i, tail in enumerate(tails):
        if tail != _NONE:
            segments[i] = segments[i][:-1] + tail


def _sha_chain(parent: bytes, segments: list[bytes]) -> list[bytes]:
    """The SHA-256 chain over CBOR payload segments (``[parent, tokens, keys]`` after the
    parent), starting from ``parent``."""
    head = _SHA_HEAD.copy  # SHA-256 with the payload's head absorbed: a copy per block
    out: list[bytes] = []
    append = out.append
    for seg in segments:
        h = head()
        h.update(parent)
        h.update(seg)
        parent = h.digest()
        append(parent)
    return out


_SHA_HEAD: Final = hashlib.sha256(_PARENT_HEAD)


def _as_tuple(keys: list[Any]) -> tuple[Any, ...] | None:
    """A block's extra keys as vLLM places them in the hashed tuple (None when empty)."""
    return tuple(keys) if keys else None


def _cbor_keys(keys: list[Any]) -> bytes:
    """CBOR of a block's extra keys (``f6`` for None)."""
    return cbor.dumps(tuple(keys)) if keys else _NONE

"""vLLM prefix-cache block hashes: ``vllm_sha256_cbor`` and ``vllm_sha256_cbor_64``.

vLLM >= 0.29 with ``prefix_caching_hash_algo="sha256_cbor"``::

    NONE_HASH  = SHA-256(cbor(seed))              seed: a str, hashed as a CBOR text string
    hash(blk)  = SHA-256(cbor((parent_digest, tuple(tokens), extra_keys_or_None)))
                 first block's parent = NONE_HASH; cbor = cbor2.dumps(..., canonical=True)

**Seed.** vLLM uses ``"vllm-none-hash"`` unless ``PYTHONHASHSEED`` is set in the engine's
environment, in which case that string is the seed. kvstream never reads the environment:
pass the engine's value explicitly, ``get_hasher("vllm_sha256_cbor", seed="0")``.

**Extra keys** of a block, a tuple in this order, or None when empty (``extra_keys="tagged"``,
vLLM >= 0.31, the default)::

    ("lora", lora_name, lora_path)        every block, when the request has a LoRA adapter
    ("mm", identifier, offset)            each multimodal key of the block, in order
    ("cache_salt", salt)                  first block only, when the request has a salt

``extra_keys="legacy"`` (vLLM 0.24-0.30) uses the untagged forms ``lora_name``,
``(identifier, offset)`` and ``salt``. A multimodal key's ``identifier`` is its hash: a str
as given (vLLM's ``mm_feature.identifier``), bytes as lowercase hex; ``offset`` is the key's
``start_offset`` as given (pass the offset your vLLM version hashes).

vLLM identifies adapters by name (and path), so a ``lora_id`` without a ``lora_name`` raises
HashingError; the tagged form needs the adapter's path too, from ``root(lora_path=...)`` or
the hasher's ``lora_paths`` mapping (name -> path). Salts are strings: ``salt_id`` raises.
Per-token extra ids and digest tokens do not exist in vLLM and raise HashingError.

Published: ``vllm_sha256_cbor`` the 32-byte digest; ``vllm_sha256_cbor_64`` its **last** 8
bytes, big-endian (the int vLLM puts in events by default).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final

from kvstream.errors import HashingError
from kvstream.hashing import cbor
from kvstream.hashing.base import BlockHasher, ChainState, per_block_args
from kvstream.hashing.blocks import coerce_many, coerce_tokens
from kvstream.hashing.multimodal import normalize_mm_keys

__all__ = ["DEFAULT_SEED", "VllmSha256CborHasher"]

DEFAULT_SEED: Final = "vllm-none-hash"
_PARENT_HEAD: Final = b"\x83\x58\x20"  # array(3), then bytes(32)
_NONE: Final = b"\xf6"
#: Requests with at least this many tokens have their token arrays encoded by numpy at once.
_VECTOR_MIN_TOKENS: Final = 512
_tuple_new = tuple.__new__


class VllmSha256CborHasher(BlockHasher):
    """vLLM's ``sha256_cbor`` prefix hash (``width`` 32) or its published u64 form (8).

    Parameters: ``seed`` (the NONE_HASH seed string), ``extra_keys`` (``"tagged"`` or
    ``"legacy"``), ``lora_paths`` (adapter name -> path, for the tagged LoRA key).
    """

    def __init__(
        self,
        width: int = 32,
        *,
        seed: str = DEFAULT_SEED,
        extra_keys: str = "tagged",
        lora_paths: Mapping[str, str] | None = None,
    ) -> None:
        if width not in (8, 32):
            raise HashingError(f"vllm_sha256_cbor publishes 32 or 8 bytes, not {width}")
        if not isinstance(seed, str):
            raise HashingError(
                f"seed must be a str (vLLM hashes PYTHONHASHSEED as a string), got {seed!r}"
            )
        if extra_keys not in ("tagged", "legacy"):
            raise HashingError(f"extra_keys must be 'tagged' or 'legacy', got {extra_keys!r}")
        self.width = width
        self.name = "vllm_sha256_cbor" if width == 32 else "vllm_sha256_cbor_64"
        self.seed = seed
        self.extra_keys = extra_keys
        self.lora_paths: Mapping[str, str] = MappingProxyType(dict(lora_paths or {}))
        self._tagged = extra_keys == "tagged"
        #: vLLM's NONE_HASH: the parent digest of a request's first block.
        self.none_hash: bytes = hashlib.sha256(cbor.dumps(seed)).digest()

    def root(
        self,
        lora_id: int | None = None,
        cache_salt: str | None = None,
        salt_id: int | None = None,
        lora_name: str | None = None,
        *,
        lora_path: str | None = None,
    ) -> ChainState:
        """Root state: parent NONE_HASH; the LoRA and salt extra keys of the request."""
        if salt_id is not None:
            raise HashingError(
                "vLLM hashes the cache_salt string; a numeric salt_id cannot be mixed in"
                + (" (and pass either cache_salt or salt_id, not both)" if cache_salt else "")
            )
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise HashingError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
        if lora_name is None and lora_id is not None:
            raise HashingError(
                f"{self.name} identifies LoRA adapters by lora_name; got lora_id={lora_id!r} "
                "without a lora_name"
            )
        lora_key: Any = None
        if lora_name is not None:
            if not isinstance(lora_name, str):
                raise HashingError(f"lora_name must be a str, got {type(lora_name).__name__}")
            if self._tagged:
                path = lora_path if lora_path is not None else self.lora_paths.get(lora_name)
                if not isinstance(path, str):
                    raise HashingError(
                        f"vLLM >= 0.31 hashes ('lora', name, path): pass lora_path for "
                        f"adapter {lora_name!r} (root(lora_path=...) or lora_paths=)"
                    )
                lora_key = ("lora", lora_name, path)
            else:
                lora_key = lora_name
        salt_key: Any = None
        if cache_salt is not None:
            salt_key = ("cache_salt", cache_salt) if self._tagged else cache_salt
        return ChainState(self.name, self.none_hash, 0, (lora_key, salt_key))

    def _extra(self, scope: tuple[Any, ...], first: bool, mm_keys: Any) -> bytes:
        """CBOR of the block's extra keys (``f6`` for None)."""
        lora_key, salt_key = scope
        keys: list[Any] = []
        if lora_key is not None:
            keys.append(lora_key)
        if mm_keys:
            for h, off in normalize_mm_keys(mm_keys):
                ident = h if isinstance(h, str) else h.hex()
                keys.append(("mm", ident, off) if self._tagged else (ident, off))
        if first and salt_key is not None:
            keys.append(salt_key)
        return cbor.dumps(tuple(keys)) if keys else _NONE

    def extend(
        self,
        state: ChainState,
        block_tokens: Any,
        mm_keys: Iterable[Any] | None = (),
        token_extra_ids: Any = None,
    ) -> tuple[bytes, ChainState]:
        """Hash one block: SHA-256(cbor((parent, tokens, extra_keys)))."""
        if type(state) is not ChainState or state.algo != self.name:
            self._check_state(state)
        if token_extra_ids is not None:
            raise HashingError("vLLM block hashes have no per-token extra ids")
        raw = coerce_tokens(block_tokens, "block_tokens")
        if not raw:
            raise HashingError("a block needs at least one token")
        tail = self._extra(state.scope, state.depth == 0, mm_keys)
        digest = hashlib.sha256(
            b"".join((_PARENT_HEAD, state.key, cbor.token_array(raw), tail))
        ).digest()
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
    ) -> list[bytes]:
        """The chain as bytes of width ``self.width``. See :meth:`BlockHasher.chain_bytes`."""
        blocks = list(blocks)
        mm, extra = per_block_args(len(blocks), mm_keys, token_extra_ids)
        if extra is not None and any(e is not None for e in extra):
            raise HashingError("vLLM block hashes have no per-token extra ids")
        state = self.root(lora_id, cache_salt, salt_id, lora_name, lora_path=lora_path)
        raws = coerce_many(blocks)
        lengths = [len(r) >> 2 for r in raws]
        if 0 in lengths:
            raise HashingError("a block needs at least one token")
        scope = state.scope
        if mm is None:
            tails = [self._extra(scope, False, None)] * len(blocks)
            if tails:
                tails[0] = self._extra(scope, True, None)
        else:
            tails = [self._extra(scope, i == 0, m) for i, m in enumerate(mm)]
        # Fast path: every block's "tokens + extra keys" segment built at once, so the loop
        # only concatenates the parent and hashes.
        if sum(lengths) >= _VECTOR_MIN_TOKENS:
            segments = cbor.token_arrays(b"".join(raws), lengths, none_tail=True)
            for i, tail in enumerate(tails):
                if tail != _NONE:
                    segments[i] = segments[i][:-1] + tail
        else:
            segments = [cbor.token_array(r) + tail for r, tail in zip(raws, tails, strict=True)]
        sha = hashlib.sha256
        parent: bytes = state.key
        out: list[bytes] = []
        append = out.append
        for seg in segments:
            parent = sha(_PARENT_HEAD + parent + seg).digest()
            append(parent)
        if self.width == 8:
            return [d[-8:] for d in out]
        return out

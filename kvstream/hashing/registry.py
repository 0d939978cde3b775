"""The registry of block-hash algorithms, keyed by the names events publish in ``hash_algo``.

Built in: ``v1_block_key``, ``v2_sha256``, ``v2_sha256_64`` (TensorRT-LLM),
``vllm_sha256_cbor``, ``vllm_sha256_cbor_64`` (vLLM >= 0.29), ``blake3``, ``blake3_64``
(kvstream's native chain). Third parties add theirs with :func:`register_hasher`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from kvstream._types import BLOCK_HASH_WIDTHS
from kvstream.errors import HashingError, UnknownHashAlgorithmError
from kvstream.hashing.base import BlockHasher
from kvstream.hashing.native import Blake3Hasher
from kvstream.hashing.trtllm import V1BlockKeyHasher, V2Sha256Hasher
from kvstream.hashing.vllm import DEFAULT_SEED, VllmSha256CborHasher

__all__ = ["HasherFactory", "available_hashers", "get_hasher", "register_hasher"]

#: Builds a hasher from algorithm-level keyword parameters (``seed=...``).
HasherFactory = Callable[..., BlockHasher]

_LOCK = threading.Lock()
_FACTORIES: dict[str, HasherFactory] = {}


def register_hasher(name: str, factory: HasherFactory, *, replace: bool = False) -> None:
    """Register ``factory`` under ``name`` (the ``hash_algo`` its hashers publish).

    ``factory(**params)`` must return a :class:`BlockHasher` whose ``name`` is ``name``
    (checked by :func:`get_hasher`). A name already registered raises HashingError unless
    ``replace`` is true.
    """
    if not isinstance(name, str) or not name:
        raise HashingError(f"a hash algorithm name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise HashingError(f"factory for {name!r} is not callable: {factory!r}")
    with _LOCK:
        if name in _FACTORIES and not replace:
            raise HashingError(
                f"hash algorithm {name!r} is already registered (pass replace=True to override)"
            )
        _FACTORIES[name] = factory


def available_hashers() -> list[str]:
    """The registered algorithm names, sorted."""
    with _LOCK:
        return sorted(_FACTORIES)


def get_hasher(name: str, **params: Any) -> BlockHasher:
    """A hasher for ``name`` with algorithm-level ``params``.

    Raises UnknownHashAlgorithmError (listing the known names) for an unregistered name,
    TypeError for a parameter the algorithm does not take, HashingError for a bad value or a
    factory whose hasher does not publish ``name`` at the width ``BLOCK_HASH_WIDTHS`` gives.
    """
    with _LOCK:
        factory = _FACTORIES.get(name)
        known = list(_FACTORIES)
    if factory is None:
        raise UnknownHashAlgorithmError(name, known)
    hasher = factory(**params)
    if not isinstance(hasher, BlockHasher):
        raise HashingError(
            f"factory for {name!r} returned {type(hasher).__name__}, not a BlockHasher"
        )
    if hasher.name != name:
        raise HashingError(f"factory for {name!r} built a hasher named {hasher.name!r}")
    expected = BLOCK_HASH_WIDTHS.get(name)
    if hasher.width not in (8, 32) or (expected is not None and hasher.width != expected):
        raise HashingError(
            f"hasher {name!r} has width {hasher.width}, expected {expected or '8 or 32'}"
        )
    return hasher


def _v1() -> BlockHasher:
    return V1BlockKeyHasher()


def _v2() -> BlockHasher:
    return V2Sha256Hasher(32)


def _v2_64() -> BlockHasher:
    return V2Sha256Hasher(8)


def _vllm(
    *,
    seed: str = DEFAULT_SEED,
    extra_keys: str = "tagged",
    lora_paths: Mapping[str, str] | None = None,
) -> BlockHasher:
    return VllmSha256CborHasher(32, seed=seed, extra_keys=extra_keys, lora_paths=lora_paths)


def _vllm_64(
    *,
    seed: str = DEFAULT_SEED,
    extra_keys: str = "tagged",
    lora_paths: Mapping[str, str] | None = None,
) -> BlockHasher:
    return VllmSha256CborHasher(8, seed=seed, extra_keys=extra_keys, lora_paths=lora_paths)


def _blake3() -> BlockHasher:
    return Blake3Hasher(32)


def _blake3_64() -> BlockHasher:
    return Blake3Hasher(8)


for _name, _factory in (
    ("v1_block_key", _v1),
    ("v2_sha256", _v2),
    ("v2_sha256_64", _v2_64),
    ("vllm_sha256_cbor", _vllm),
    ("vllm_sha256_cbor_64", _vllm_64),
    ("blake3", _blake3),
    ("blake3_64", _blake3_64),
):
    register_hasher(_name, _factory)

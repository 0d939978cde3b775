"""The registry of block-hash algorithms, keyed by the names events publish in ``hash_algo``.

Built in, with their algorithm-level parameters (``get_hasher(name, **params)``):

- ``v1_block_key``: TensorRT-LLM V1 ``BlockKeyHasher`` (64-bit); ``salt_hash`` (``"blake3"``,
  the default, ``"sha256"`` or ``"libstdcxx"``: :mod:`kvstream.hashing.salt`), ``native``.
- ``v2_sha256``, ``v2_sha256_64``: TensorRT-LLM V2 radix keys; ``salt_hash`` (default
  ``"sha256"``), ``encoding`` (``"u32"``, ``"u64"``, ``"u64_lora_root"``).
- ``vllm_sha256``, ``vllm_sha256_64``: vLLM's default ``sha256`` (pickle);
  ``vllm_sha256_cbor``, ``vllm_sha256_cbor_64``: vLLM's ``sha256_cbor``. Both take ``seed``,
  ``extra_keys`` (``"tagged"`` or ``"legacy"``) and ``lora_paths``.
- ``sglang_sha256_64``: SGLang's KV-event page hash; ``event_format`` (``"default"`` or
  ``"dynamo"``).
- ``dynamo_xxh3_64``: Dynamo's unchained per-block ``tokens_hash`` (XXH3-64, seed 1337).
- ``blake3``, ``blake3_64``: kvstream's native chain.

Third parties add theirs with :func:`register_hasher`: a :class:`BlockHasher` subclass that
implements ``_root(scope)`` (a :class:`~kvstream.hashing.scope.HashScope`) and ``extend``; one
written before HashScope, overriding ``root(lora_id, cache_salt, ...)`` instead, still works.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvstream._types import BLOCK_HASH_WIDTHS
from kvstream.errors import ConfigError, HashingError, UnknownHashAlgorithmError, did_you_mean
from kvstream.hashing.base import BlockHasher
from kvstream.hashing.dynamo import DynamoXxh3Hasher
from kvstream.hashing.native import Blake3Hasher

if TYPE_CHECKING:
    from kvstream.hashing.vllm import VllmHasherBase

__all__ = [
    "HasherFactory",
    "available_hashers",
    "check_hash_algo",
    "get_hasher",
    "register_hasher",
]

#: The longest ``hash_algo`` name an event may carry (the TensorRT-LLM reader's limit too).
MAX_ALGO_NAME = 64

#: Builds a hasher from algorithm-level keyword parameters (``seed=...``).
HasherFactory = Callable[..., BlockHasher]

_LOCK = threading.Lock()
_UNSET: Any = object()
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


def check_hash_algo(
    name: str, *, allow_unknown: bool = False, where: str = "hash_algo", hint: str = ""
) -> str:
    """``name`` when it is a registered algorithm; ConfigError otherwise.

    For every place a user names an algorithm that kvstream publishes or hashes with (URL
    options, config, CLI flags): a typo must fail there, not downstream. The error names
    ``where``, the closest known name (difflib) and the known ones. ``allow_unknown`` lets a
    name kvstream does not know pass (a newer engine's algorithm, published as given): it
    must then still be 1..64 characters. ``hint`` ends the message (how to allow one).
    """
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_ALGO_NAME:
        raise ConfigError(f"{where}: an algorithm name is 1..{MAX_ALGO_NAME} characters")
    known = available_hashers()
    if name in known or allow_unknown:
        return name
    raise ConfigError(
        f"{where}: unknown hash algorithm {name!r}{did_you_mean(name, known)}; known "
        f"algorithms: {', '.join(known)}{hint}"
    )


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


# The engines' algorithms are imported when first asked for: their modules bring numpy
# (~14 MiB of RSS), which a process hashing only with Dynamo's or kvstream's own never needs.


def _v1(*, salt_hash: str = "blake3", native: bool | None = None) -> BlockHasher:
    from kvstream.hashing.trtllm import V1BlockKeyHasher

    return V1BlockKeyHasher(native=native, salt_hash=salt_hash)


def _v2(*, salt_hash: str = "sha256", encoding: str = "u32") -> BlockHasher:
    from kvstream.hashing.trtllm import V2Sha256Hasher

    return V2Sha256Hasher(32, salt_hash=salt_hash, encoding=encoding)


def _v2_64(*, salt_hash: str = "sha256", encoding: str = "u32") -> BlockHasher:
    from kvstream.hashing.trtllm import V2Sha256Hasher

    return V2Sha256Hasher(8, salt_hash=salt_hash, encoding=encoding)


def _vllm_cbor() -> type[VllmHasherBase]:
    from kvstream.hashing.vllm import VllmSha256CborHasher

    return VllmSha256CborHasher


def _vllm_pickle() -> type[VllmHasherBase]:
    from kvstream.hashing.vllm_pickle import VllmSha256PickleHasher

    return VllmSha256PickleHasher


def _vllm_factory(load: Callable[[], type[VllmHasherBase]], width: int) -> HasherFactory:
    """A factory of the vLLM hasher class ``load()`` returns; ``seed`` defaults to the class's
    own default (vLLM's ``DEFAULT_SEED``)."""

    def factory(
        *,
        seed: Any = _UNSET,
        extra_keys: str = "tagged",
        lora_paths: Mapping[str, str] | None = None,
    ) -> BlockHasher:
        given = {} if seed is _UNSET else {"seed": seed}
        return load()(width, extra_keys=extra_keys, lora_paths=lora_paths, **given)

    return factory


def _sglang(*, event_format: str = "default") -> BlockHasher:
    from kvstream.hashing.sglang import SglangSha256Hasher

    return SglangSha256Hasher(event_format=event_format)


def _dynamo() -> BlockHasher:
    return DynamoXxh3Hasher()


def _blake3() -> BlockHasher:
    return Blake3Hasher(32)


def _blake3_64() -> BlockHasher:
    return Blake3Hasher(8)


for _name, _factory in (
    ("v1_block_key", _v1),
    ("v2_sha256", _v2),
    ("v2_sha256_64", _v2_64),
    ("vllm_sha256", _vllm_factory(_vllm_pickle, 32)),
    ("vllm_sha256_64", _vllm_factory(_vllm_pickle, 8)),
    ("vllm_sha256_cbor", _vllm_factory(_vllm_cbor, 32)),
    ("vllm_sha256_cbor_64", _vllm_factory(_vllm_cbor, 8)),
    ("sglang_sha256_64", _sglang),
    ("dynamo_xxh3_64", _dynamo),
    ("blake3", _blake3),
    ("blake3_64", _blake3_64),
):
    register_hasher(_name, _factory)

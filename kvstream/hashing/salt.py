"""TensorRT-LLM's cache-salt string -> 64-bit salt id, in each of its three derivations.

TensorRT-LLM hashes a numeric salt id, not the ``cache_salt`` string, and which function turns
the string into the id depends on the component that built the hash. Sources read in
NVIDIA/TensorRT-LLM (state of ``main`` described in issue #18156, 2026-08-24):

``"blake3"``: BLAKE3(utf-8)[:8], little-endian. ``tensorrt_llm.inputs.utils.get_cache_salt_id``
    (``default_hasher = blake3``, ``inputs/multimodal.py``), which the LLM API calls
    (``BaseLLM.generate_async``, ``llmapi/llm.py``) to fill the request's ``cache_salt_id``; the
    V1 C++ ``BlockKeyHasher`` (``batch_manager/blockKey.cpp`` @0bd2980d, @2bb816c6) mixes that
    id into a request's first block. The KV-cache-aware router (``serve/router_utils.py`` ->
    ``runtime/kv_cache_hash.get_cache_salt_id``) uses it too: ``tests/unittest/disaggregated/
    test_router.py`` @00895e31 pins ``get_cache_salt_id("abc") == 3697813978277427044`` and its
    equality with the worker path. ``"tenant-A"`` -> 11905099046384790080.
``"sha256"``: SHA-256(utf-8)[:8], little-endian. ``KVCacheManagerV2._derive_reuse_salt``
    (``_torch/pyexecutor/kv_cache_manager_v2.py``; quoted in issue #18156 and in the diff of PR
    #18160): the V2 manager's ``ReuseScope`` salt, hence every hash a V2 worker publishes:
    ``v2_sha256``, ``v2_sha256_64`` and ``v1_block_key`` in its v1-compatible mode (``auto``
    resolves to ``v1_block_key``, PR #13624). PR #18160 (open) moves the router's
    ``kv_cache_hash.get_cache_salt_id`` to this derivation (``kv_cache_hash.py`` @991de58c).
    ``"tenant-A"`` -> 10590430051267512242.
``"libstdcxx"``: ``std::hash<std::string>`` of libstdc++ on 64-bit targets (``_Hash_bytes``,
    seed 0xc70f6907): V1 C++ builds that mix ``std::hash(cacheSalt)`` rather than an id (the
    note in ``kv_cache_hash.py`` @991de58c). Implementation-defined: only libstdc++ builds give
    this value. ``"tenant-A"`` -> 11647872923530560891.

kvstream's defaults follow what each engine publishes: ``v1_block_key`` uses ``"blake3"`` (the
V1 manager and the router), ``v2_sha256``/``v2_sha256_64`` use ``"sha256"`` (only the V2
manager produces them). Pick another with ``get_hasher(name, salt_hash=...)``, e.g.
``salt_hash="sha256"`` for ``v1_block_key`` hashes published by a V2 worker.
"""

from __future__ import annotations

import hashlib
from typing import Final

from blake3 import blake3

from kvstream.errors import HashingError

__all__ = ["SALT_HASHES", "cache_salt_id", "check_salt_hash"]

#: The salt-id derivations :func:`cache_salt_id` implements.
SALT_HASHES: Final = ("blake3", "sha256", "libstdcxx")

_M64: Final = 0xFFFFFFFFFFFFFFFF
_MURMUR_MUL: Final = 0xC6A4A7935BD1E995
_LIBSTDCXX_SEED: Final = 0xC70F6907


def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)


def _libstdcxx_hash(data: bytes) -> int:
    """libstdc++'s 64-bit ``std::_Hash_bytes(data, len, 0xc70f6907)`` (std::hash<string>)."""
    mul = _MURMUR_MUL
    n = len(data)
    aligned = n & ~7
    h = (_LIBSTDCXX_SEED ^ (n * mul)) & _M64
    for i in range(0, aligned, 8):
        word = (_shift_mix((int.from_bytes(data[i : i + 8], "little") * mul) & _M64) * mul) & _M64
        h = ((h ^ word) * mul) & _M64
    if n & 7:
        h = ((h ^ int.from_bytes(data[aligned:], "little")) * mul) & _M64
    h = (_shift_mix(h) * mul) & _M64
    return _shift_mix(h)


def check_salt_hash(salt_hash: object) -> str:
    """``salt_hash`` if it names a derivation in :data:`SALT_HASHES`, else HashingError."""
    if salt_hash not in SALT_HASHES:
        raise HashingError(f"salt_hash must be one of {', '.join(SALT_HASHES)}; got {salt_hash!r}")
    return str(salt_hash)


def cache_salt_id(cache_salt: str, salt_hash: str = "blake3") -> int:
    """The uint64 salt id TensorRT-LLM derives from ``cache_salt`` (see the module docstring).

    ``salt_hash`` picks the derivation; the default is the LLM API's (and the router's)
    ``get_cache_salt_id``: ``cache_salt_id("tenant-A") == 11905099046384790080``.
    Raises HashingError for a non-str salt or an unknown derivation.
    """
    if not isinstance(cache_salt, str):
        raise HashingError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
    try:
        data = cache_salt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise HashingError(f"cache_salt is not encodable as UTF-8: {exc}") from None
    if salt_hash == "blake3":
        return int.from_bytes(blake3(data).digest()[:8], "little")
    if salt_hash == "sha256":
        return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")
    if salt_hash == "libstdcxx":
        return _libstdcxx_hash(data)
    check_salt_hash(salt_hash)
    raise AssertionError("unreachable")  # pragma: no cover

"""SGLang's KV-event page hash: ``sglang_sha256_64``.

SGLang 0.5.23 (``srt/mem_cache/cpp_utils/hash_binding.cpp``, ``srt/mem_cache/utils.py``,
``srt/mem_cache/events.py``, ``srt/disaggregation/kv_events.py``) hashes each page (block) of a
radix-tree path with a SHA-256 chain, with no seed in the default namespace::

    d_0 = SHA256(start || page_0)          start: nothing, or the salt seed (below)
    d_i = SHA256(d_{i-1} || page_i)
    page = each token as u32 little-endian; a page holding any id >= 2**32 is instead
           0xff || each token as u64 little-endian   (ids must be below 2**63)

    published(d) = first 8 bytes of d                                  (no namespace)
                 = first 8 bytes of SHA256(ns_seed || first 8 bytes of d)   (namespaced)

Events carry ``published`` as a **signed** int64 (big-endian two's complement of those 8
bytes); kvstream keeps the 8 bytes, so ``chain()`` returns the unsigned value and
``hash_from_int(signed)`` / ``int.from_bytes(b, "big", signed=True)`` convert. Partial trailing
pages are hashed like full ones. EAGLE "bigram" pages hash the flattened pairs: pass each page's
``(a, b)`` pairs flattened into one block. Multimodal items reach the hash through their pad
token ids (pass the padded tokens); ``mm_keys`` and per-token extra ids raise HashingError.

**Request scope.** SGLang namespaces a radix path by ``extra_key`` (a caller-defined string; a
LoRA request appends its adapter's ``lora_id``, a 32-character uuid hex, so
``extra_key = (extra_key or "") + lora_id``) and ``cache_salt`` (a string; empty is none):

- a salt starts the chain at ``start = SHA256(b"sglang-cache-salt-v1\\0" + salt_utf8)``;
- ``ns_seed = SHA256(b"sglang-kv-event-namespace-v1" || part(extra_key) || part(salt))`` with
  ``part(None) = 00`` and ``part(s) = 01 || len(utf8) as u64 LE || utf8``. Which parts are used
  depends on the publisher's ``format`` (``event_format=``): ``"default"`` namespaces only a
  LoRA request's ``extra_key`` (the salt part is always None); ``"dynamo"`` namespaces
  ``(extra_key, cache_salt)`` whenever either is set.

``root()`` takes ``cache_salt``; ``lora_id`` as SGLang's adapter id string; ``lora_name`` (marks
the request as a LoRA request when its ``extra_key`` already ends with the adapter id); and the
keyword-only ``extra_key``. A numeric ``salt_id`` or an int ``lora_id`` raises HashingError.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable
from typing import Any, Final

import numpy as np

from kvstream._types import TokenIds
from kvstream.errors import HashingError
from kvstream.hashing.accel import KIND_SGLANG, native_chains
from kvstream.hashing.base import BlockHasher, ChainState, HashScope, PerBlock, check_str
from kvstream.hashing.blocks import Where, coerce_tokens

__all__ = ["EVENT_FORMATS", "SglangSha256Hasher", "namespace_seed", "salt_seed"]

#: The values of SGLang's ``--kv-events-config`` ``format`` key.
EVENT_FORMATS: Final = ("default", "dynamo")
_SALT_TAG: Final = b"sglang-cache-salt-v1\x00"
_NAMESPACE_TAG: Final = b"sglang-kv-event-namespace-v1"
_WIDE_TAG: Final = b"\xff"
_I64_MAX: Final = 2**63 - 1
_sha256 = hashlib.sha256
_tuple_new = tuple.__new__


def salt_seed(cache_salt: str) -> bytes:
    """The digest a salted chain starts from: SHA256("sglang-cache-salt-v1\\0" + salt)."""
    return hashlib.sha256(_SALT_TAG + cache_salt.encode("utf-8")).digest()


def namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """SGLang's ``kv_event_namespace_seed``: None when both parts are None."""
    if extra_key is None and cache_salt is None:
        return None
    h = hashlib.sha256(_NAMESPACE_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            h.update(b"\x00")
        else:
            data = part.encode("utf-8")
            h.update(b"\x01" + len(data).to_bytes(8, "little") + data)
    return h.digest()


def _wide_page(block: Any, where: Where) -> bytes:
    """0xff || u64 LE tokens, for a page holding an id >= 2**32 (ids must be < 2**63)."""
    if isinstance(block, np.ndarray):
        if block.ndim != 1 or block.dtype.kind not in "iu":
            raise HashingError(f"{where}: a numpy token block must be a 1-D integer array")
        items: list[Any] = block.tolist()
    elif isinstance(block, (list, tuple, range, array)):
        items = list(block)
    else:
        raise HashingError(f"{where}: a block must be a sequence of token ids")
    for i, tok in enumerate(items):
        if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
            raise HashingError(f"{where}[{i}] = {tok!r}: token ids must be ints")
        if not 0 <= int(tok) <= _I64_MAX:
            raise HashingError(f"{where}[{i}] = {int(tok)}: SGLang token ids must be in 0..2**63-1")
    words = array("Q", [int(t) for t in items])
    if sys.byteorder != "little":  # pragma: no cover
        words.byteswap()
    return _WIDE_TAG + words.tobytes()


def _u32_pages(blocks: list[Any]) -> list[bytes] | None:
    """Every page's u32 LE bytes, or None when one is not a sequence of u32 ids (a wide page,
    or an error the reference loop reports)."""
    pages: list[bytes] = []
    for i, b in enumerate(blocks):
        if type(b) is TokenIds:
            pages.append(b._raw)
            continue
        try:
            pages.append(coerce_tokens(b, i))
        except HashingError:
            return None
    return pages


def _page(block: Any, where: Where) -> bytes:
    """The bytes SGLang hashes for one page (after the parent digest)."""
    if type(block) is TokenIds:
        raw: bytes = block._raw
        return raw
    try:
        return coerce_tokens(block, where)
    except HashingError:
        return _wide_page(block, where)


class SglangSha256Hasher(BlockHasher):
    """``sglang_sha256_64``: SGLang's KV-event page hash (see the module docstring).

    ``event_format`` is the publisher's ``format`` (``"default"`` or ``"dynamo"``). ``native``
    picks the whole-request C chain of ``u32`` pages (:mod:`kvstream.hashing.accel`): None
    (default) when built, False never, True required.
    """

    name = "sglang_sha256_64"
    width = 8
    _no_extra_ids = "SGLang page hashes have no per-token extra ids"
    _takes_extra_key = True
    _no_mm_keys = (
        "SGLang hashes multimodal items through their pad token ids; pass the padded tokens, "
        "not mm_keys"
    )
    _c_kind = KIND_SGLANG

    def __init__(self, *, event_format: str = "default", native: bool | None = None) -> None:
        if event_format not in EVENT_FORMATS:
            raise HashingError(
                f"event_format must be one of {', '.join(EVENT_FORMATS)}; got {event_format!r}"
            )
        self.event_format: str = event_format
        self._c: Any = native_chains(native, self.name)
        #: Whether chains of u32 pages run in C.
        self.native: bool = self._c is not None

    def _c_args(
        self, state: ChainState, tokens_per_block: int
    ) -> tuple[bytes, int, bytes | None, bytes | None]:
        # no parent (b""): an unsalted chain's first page; the tail is the namespace seed
        key = state.key
        return (b"" if key is None else key), 0, None, state.scope[0]

    def _root(self, scope: HashScope) -> ChainState:
        """Root state: key = the salt seed or None; scope = (namespace seed,)."""
        lora_id, cache_salt, salt_id = scope.lora_id, scope.cache_salt, scope.salt_id
        lora_name, extra_key = scope.lora_name, scope.extra_key
        if salt_id is not None:
            raise HashingError("SGLang hashes the cache_salt string; a numeric salt_id is not used")
        check_str("cache_salt", cache_salt)
        check_str("extra_key", extra_key)
        if lora_id is not None and not isinstance(lora_id, str):
            raise HashingError(
                "SGLang identifies LoRA adapters by their lora_id string (LoRARef.lora_id, a "
                f"uuid hex); got {type(lora_id).__name__}"
            )
        check_str("lora_name", lora_name)
        if lora_id is not None:
            extra_key = (extra_key or "") + lora_id
        elif lora_name is not None and extra_key is None:
            raise HashingError(
                f"SGLang namespaces LoRA requests by extra_key + lora_id; got lora_name="
                f"{lora_name!r} without the adapter's lora_id (or an extra_key ending in it)"
            )
        salt = cache_salt or None  # SGLang: Req.cache_salt = cache_salt or None
        if self.event_format == "dynamo":
            seed = namespace_seed(extra_key, salt)
        else:
            is_lora = lora_id is not None or lora_name is not None
            seed = namespace_seed(extra_key if is_lora else None, None)
        start = None if salt is None else salt_seed(salt)
        return ChainState(self.name, start, 0, (seed,))

    def extend(
        self,
        state: ChainState,
        block_tokens: Any,
        mm_keys: Iterable[Any] | None = (),
        token_extra_ids: Any = None,
    ) -> tuple[bytes, ChainState]:
        """Hash one page: d = SHA256(parent || page); publish its (namespaced) first 8 bytes."""
        if type(state) is not ChainState or state.algo != self.name:
            self._check_state(state)
        if mm_keys:
            raise HashingError(self._no_mm_keys)
        if token_extra_ids is not None:
            raise HashingError(self._no_extra_ids)
        page = _page(block_tokens, "block_tokens")
        if not page:
            raise HashingError("a block needs at least one token")
        parent = state.key
        digest = _sha256(page if parent is None else parent + page).digest()
        seed = state.scope[0]
        published = digest[:8] if seed is None else _sha256(seed + digest[:8]).digest()[:8]
        return published, _tuple_new(ChainState, (self.name, digest, state.depth + 1, state.scope))

    def _chain(
        self, state: ChainState, blocks: list[Any], mm: PerBlock, extra: PerBlock
    ) -> list[bytes]:
        parent: bytes | None = state.key
        seed = state.scope[0]
        c = self._c
        if c is not None:
            pages = _u32_pages(blocks)
            if pages is not None:
                published: list[bytes] = c.chain(
                    KIND_SGLANG, pages, 0, b"" if parent is None else parent, 0, 8, 0, None, seed
                )[0]
                return published
        sha = _sha256
        out: list[bytes] = []
        append = out.append
        for i, b in enumerate(blocks):
            page = _page(b, i)
            if not page:
                raise HashingError(f"blocks[{i}]: a block needs at least one token")
            parent = sha(page if parent is None else parent + page).digest()
            append(parent[:8] if seed is None else sha(seed + parent[:8]).digest()[:8])
        return out

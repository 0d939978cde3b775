"""Token-derived block keys: one canonical chain for every engine's blocks.

In ``PrefixIndex(key_mode="tokens")`` blocks are navigated by a key kvstream computes from
the block's token ids, its parent's key and the scope that separates blocks, not by the
engine's hash. Engines that hash differently (vLLM's CBOR or pickle hashes, SGLang's page
hash, TensorRT-LLM's ``v1_block_key``/``v2_sha256``, kvstream's ``blake3``) then share one
key space, and a request is hashed once per block size, whoever holds its blocks. The
engine's hash stays the id that ``removed``/``updated`` events name (see
:mod:`kvstream.index.token_table`).

Definition (``kvstream_tokens_v2``; any change needs a new name)::

    ROOT = 16 zero bytes                         the parent key of a chain's first block

    plain block  (token ids only: no LoRA, no salt, no multimodal or other extra keys)
        key = XXH3-128(parent_key || each token id as u32 little-endian)
              (seed 0, the 16 bytes in XXH3's canonical big-endian form, what
              ``xxhash.xxh3_128_digest`` returns)

    scoped block (anything else)
        key = BLAKE3-derive_key(context "kvstream.index token block key v1",
                  parent_key || CBOR([tokens, lora, salt, mm, extra_ids, other]))[:16]

        tokens     the token ids as u32 little-endian (a CBOR byte string)
        lora       null | ["name", lora_name] | ["id", lora_id]   (the name wins when both)
        salt       null | cache_salt string            (the first block of a chain only)
        mm         [[identifier, offset], ...]          (bytes identifiers as lowercase hex)
        extra_ids  null | [per-token extra id, ...]     (TensorRT-LLM prompt-table ids)
        other      [extra key, ...]   the engine's remaining extra keys, verbatim

    CBOR is the canonical (deterministic) encoding of :mod:`kvstream.hashing.cbor`.

A block's scope comes from its :class:`~kvstream.events.model.StoredBlock` fields and, for
engines that publish them only there (vLLM), from ``extra_keys`` as the model documents
them: a string equal to ``lora_name`` is the LoRA (already counted), another string on a
chain's first block is the cache salt, an ``(identifier, offset)`` pair is a multimodal key
(used when ``mm_keys`` is empty), anything else (a prompt-embeds digest, an int, another
shape) is kept verbatim in ``other``, which no request can present: such blocks are never
matched rather than matched wrongly. The salt enters the first block only and reaches the
rest of the chain through the parent keys, as in vLLM and TensorRT-LLM. Layer groups are
separated by the index (one domain per group), not by the key.

Keys are 128-bit: collisions are negligible for any fleet, and a collision could only
mis-route a request, never corrupt a cache (engines verify with their own hashes). Nothing
here needs a cryptographic hash: the keys are never secret and an engine checks its own.

``kvstream_tokens_v1`` (:data:`LEGACY_ALGOS`) was the same chain with plain keys
``BLAKE3(parent_key || tokens)[:16]``. Three BLAKE3 compressions per 32-token block, each
waiting on the one before since every key chains from its parent's, were a fifth of
token-keyed ingest and the whole of its gap to the Dynamo-keyed mode (issue 22 §3); XXH3-128
of the same 144 bytes costs about a tenth as much. Scoped blocks, rare and costly for other
reasons (CBOR), keep their BLAKE3 derive-key definition, whose context separates them from
plain ones. Keys of the two definitions differ for every block, so a v1 index cannot be
converted (its nodes keep no tokens): :mod:`kvstream.index.snapshot` refuses a v1
token-keyed snapshot with a :class:`~kvstream.index.errors.SnapshotError`, and the index
is rebuilt by replaying its source.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any, Final

from blake3 import blake3

from kvstream.errors import ConfigError, HashingError
from kvstream.events.model import StoredBlock
from kvstream.hashing import cbor
from kvstream.hashing.accel import native_chains, pack_request
from kvstream.hashing.dynamo import LOCAL_HASH_SEED, block_hash_seed, link_hash, local_hash
from kvstream.hashing.dynamo import mm_suffix as _mm_suffix
from kvstream.hashing.xxh3 import xxh3_64, xxh3_128

_xxh3_be: Final = xxh3_64  # local_hash (seeded) and link_hash, for the per-block loops

__all__ = [
    "CANONICAL_ALGO",
    "DYNAMO_ALGO",
    "KEY_CONTEXT",
    "KEY_SIZE",
    "ROOT_KEY",
    "KeyMode",
    "LEGACY_ALGOS",
    "LoraScope",
    "block_payload",
    "chain_key",
    "dynamo_key",
    "dynamo_payload",
    "NATIVE_DYNAMO_KEYS",
    "dynamo_request_keys",
    "keys_from_i64",
    "keys_from_local",
    "py_dynamo_request_keys",
    "py_keys_from_i64",
    "py_keys_from_local",
    "lora_scopes",
    "request_keys",
    "request_mm",
]

#: The name under which token-keyed domains appear (``DomainKey.hash_algo``).
CANONICAL_ALGO: Final = "kvstream_tokens_v2"
#: Earlier definitions of the canonical chain (module docstring); nothing keys by them now.
LEGACY_ALGOS: Final = ("kvstream_tokens_v1",)
#: The name under which Dynamo-keyed domains appear (``key_mode="dynamo"``).
DYNAMO_ALGO: Final = "dynamo_local_v1"
#: Bytes of a key.
KEY_SIZE: Final = 16
#: The parent key of a chain's first block.
ROOT_KEY: Final = bytes(KEY_SIZE)
#: The C extension (:mod:`kvstream.hashing._chainnative`) with its Dynamo-key functions; None
#: when not built (or built before they existed) or with ``KVSTREAM_NO_NATIVE=1``.
_c: Any = native_chains(None, "dynamo keys")
if not hasattr(_c, "dynamo_keys"):
    _c = None
#: Whether the Dynamo keys (``key_mode="dynamo"``) are computed in C.
NATIVE_DYNAMO_KEYS: Final[bool] = _c is not None
#: BLAKE3 key-derivation context of scoped blocks (separates them from plain ones).
KEY_CONTEXT: Final = "kvstream.index token block key v1"

_DOMAIN_ALGOS: Final[dict[KeyMode, str | None]] = {}

#: A LoRA scope: ``("name", str)``, ``("id", int)`` or None.
LoraScope = tuple[str, str | int] | None


class KeyMode(str, enum.Enum):
    """How the index keys blocks: by the engine's hash, or by token-derived keys."""

    ENGINE = "engine"
    TOKENS = "tokens"
    DYNAMO = "dynamo"

    @property
    def token_keyed(self) -> bool:
        """True for the modes that key blocks by their tokens (``tokens``, ``dynamo``)."""
        return self is not KeyMode.ENGINE

    @property
    def domain_algo(self) -> str | None:
        """The ``DomainKey.hash_algo`` of this mode's domains (None: each worker's own)."""
        return _DOMAIN_ALGOS[self]

    @classmethod
    def parse(cls, value: KeyMode | str) -> KeyMode:
        """The mode named ``value``; ConfigError for anything else."""
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ConfigError(f"unknown key mode {value!r}; use one of {names}") from None


_DOMAIN_ALGOS.update(
    {KeyMode.ENGINE: None, KeyMode.TOKENS: CANONICAL_ALGO, KeyMode.DYNAMO: DYNAMO_ALGO}
)


def chain_key(parent: bytes, payload: bytes, scoped: bool) -> bytes:
    """The key of a block after ``parent`` (see the module docstring); ``payload`` is the
    raw tokens of a plain block or the CBOR scope of a scoped one."""
    if scoped:
        return blake3(parent + payload, derive_key_context=KEY_CONTEXT).digest(KEY_SIZE)
    return xxh3_128(parent + payload)


def _scoped(
    raw: bytes,
    lora: LoraScope,
    salt: str | None,
    mm: Sequence[tuple[str, int]],
    *,
    extra_ids: Sequence[int] | None = None,
    other: Sequence[Any] = (),
) -> bytes:
    return cbor.dumps(
        (
            raw,
            lora,
            salt,
            tuple(mm),
            None if extra_ids is None else tuple(extra_ids),
            tuple(other),
        )
    )


def _ident(value: Any) -> str | None:
    """A multimodal identifier as the key uses it (None: not an identifier)."""
    if type(value) is str:
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    return None


def block_payload(block: StoredBlock, first: bool) -> tuple[bytes, bool]:
    """``(payload, scoped)`` of a stored block with token ids, for :func:`chain_key`.

    ``first``: the block starts a chain (``parent_hash`` null and first of its event), so a
    cache salt applies to it.
    """
    raw = block.token_ids.raw
    name = block.lora_name
    lid = block.lora_id
    salt = block.cache_salt if first else None
    extra = block.extra_keys
    ids = block.token_extra_ids
    if (
        extra is None
        and name is None
        and lid is None
        and salt is None
        and ids is None
        and not block.mm_keys
    ):
        return raw, False
    lora: LoraScope = None
    if name is not None:
        lora = ("name", name)
    elif lid is not None:
        lora = ("id", lid)
    mm = [(k.hash.hex(), k.start_offset) for k in block.mm_keys]
    other: list[Any] = []
    if extra:
        pairs: list[tuple[str, int]] = []
        for item in extra:
            if type(item) is str:
                if item in (name, block.cache_salt):
                    continue
                if first and salt is None:
                    salt = item
                    continue
            elif type(item) is tuple and len(item) == 2 and type(item[1]) is int:
                ident = _ident(item[0])
                if ident is not None:
                    pairs.append((ident, item[1]))
                    continue
            other.append(item)
        if not mm:
            mm = pairs
    if lora is None and salt is None and not mm and ids is None and not other:
        return raw, False
    extra_ids = None if ids is None else ids.tolist()
    return _scoped(raw, lora, salt, mm, extra_ids=extra_ids, other=other), True


def lora_scopes(lora_name: str | None, lora_id: int | None) -> list[LoraScope]:
    """The LoRA scopes a request is matched under: its name, its id, or both (a request
    naming both matches blocks published under either; the caller vouches that they are
    the same adapter)."""
    out: list[LoraScope] = []
    if lora_name is not None:
        if not isinstance(lora_name, str):
            raise HashingError(f"lora_name must be a str, got {type(lora_name).__name__}")
        out.append(("name", lora_name))
    if lora_id is not None:
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 0:
            raise HashingError(f"lora_id must be a non-negative int, got {lora_id!r}")
        out.append(("id", lora_id))
    return out or [None]


def request_mm(mm_keys: Sequence[Any] | None, n_blocks: int) -> list[list[tuple[str, int]]] | None:
    """Per-block multimodal keys of a request as the key uses them (None when it has none).

    Each block's entry is None/empty or keys given as ``(identifier, offset)`` pairs or
    objects with ``.hash``/``.start_offset`` (:class:`~kvstream.events.model.MmKey`)."""
    if not mm_keys:
        return None
    out: list[list[tuple[str, int]]] = []
    for i in range(n_blocks):
        entry: Iterable[Any] | None = mm_keys[i] if i < len(mm_keys) else None
        keys: list[tuple[str, int]] = []
        for j, key in enumerate(entry or ()):
            if isinstance(key, (tuple, list)) and len(key) == 2:
                h, off = key
            elif hasattr(key, "hash") and hasattr(key, "start_offset"):
                h, off = key.hash, key.start_offset
            else:
                raise HashingError(f"mm_keys[{i}][{j}] must be (identifier, offset), got {key!r}")
            ident = _ident(h)
            if ident is None or isinstance(off, bool) or not isinstance(off, int):
                raise HashingError(
                    f"mm_keys[{i}][{j}] must be (str or bytes identifier, int offset), got {key!r}"
                )
            keys.append((ident, off))
        out.append(keys)
    return out if any(out) else None


def request_keys(
    raw: bytes,
    tokens_per_block: int,
    lora: LoraScope = None,
    cache_salt: str | None = None,
    mm: Sequence[Sequence[tuple[str, int]]] | None = None,
) -> list[bytes]:
    """The keys of the full blocks of a request whose token ids are ``raw`` (u32 LE bytes,
    see :func:`kvstream.hashing.blocks.coerce_tokens`), under one LoRA scope."""
    step = 4 * tokens_per_block
    end = len(raw) - len(raw) % step
    key = ROOT_KEY
    out: list[bytes] = []
    append = out.append
    if lora is None and cache_salt is None and mm is None:
        xxh = xxh3_128
        for i in range(0, end, step):
            key = xxh(key + raw[i : i + step])
            append(key)
        return out
    for n, i in enumerate(range(0, end, step)):
        block = raw[i : i + step]
        salt = cache_salt if n == 0 else None
        keys = mm[n] if mm is not None and n < len(mm) else ()
        if lora is None and salt is None and not keys:
            key = chain_key(key, block, False)
        else:
            key = chain_key(key, _scoped(block, lora, salt, keys), True)
        append(key)
    return out


def request_raw(tokens: Any, drop_last_token: bool) -> bytes:
    """A request's token ids as u32 LE bytes (without the last one when
    ``drop_last_token``); HashingError for bad ids. A list or tuple is packed in C when the
    extension is loaded (:func:`~kvstream.hashing.accel.pack_request`: an 8k-token list in
    ~10 us, where ``array("I", ...)`` takes ~60)."""
    return pack_request(tokens, drop_last_token)


# ---------------------------------------------------------------------------- Dynamo keys
#
# ``key_mode="dynamo"`` (definition ``dynamo_local_v1``): a block's content is NVIDIA Dynamo's
# local hash of its tokens (``dynamo_xxh3_64``: XXH3-64, seed 1337 plus the LoRA name's hash,
# multimodal hashes appended; :mod:`kvstream.hashing.dynamo`), 8 bytes big-endian, and its
# key chains it under the parent's key, keeping the local hash readable in the key's second
# half (Dynamo's ``/dump`` lists every block's ``tokens_hash``)::
#
#     key = XXH3-64(parent_key || local_hash) || local_hash      (16 bytes, big-endian halves)
#
# A path of keys is a path of local hashes from the root, which is what Dynamo's radix tree
# navigates, so the index answers as Dynamo's indexer does, and a request given as Dynamo's
# local hashes (its ``/query_by_hash``) is matched without its tokens.


def dynamo_payload(fields: Any, raw: bytes) -> bytes:
    """The local hash (8 bytes big-endian) of a stored block, from its model fields
    (``StoredBlock.__dict__``) and its raw u32 LE tokens."""
    name = fields["lora_name"]
    mm = fields["mm_keys"]
    if name is None and not mm:
        return local_hash(raw, LOCAL_HASH_SEED)
    if mm:
        raw = raw + _mm_suffix(mm)
    return local_hash(raw, block_hash_seed(name))


def dynamo_key(parent: bytes, local: bytes) -> bytes:
    """The key of a block whose local hash is ``local`` under the key ``parent``."""
    return link_hash(parent, local) + local


def py_keys_from_local(local_hashes: Sequence[bytes], parent: bytes = ROOT_KEY) -> list[bytes]:
    """The keys of a request given as Dynamo local hashes (8 bytes each), chained from
    ``parent`` (the root by default). Pure Python (the reference of the C path)."""
    key = parent
    out: list[bytes] = []
    append = out.append
    xxh3 = _xxh3_be  # link_hash(key, h), inlined: this loop is the fallback's per-block cost
    for h in local_hashes:
        key = xxh3(key + h) + h
        append(key)
    return out


def keys_from_local(local_hashes: Sequence[bytes]) -> list[bytes]:
    """The keys of a request given as Dynamo local hashes (8 bytes each), from the root."""
    if _c is not None:
        out: list[bytes] | None = _c.dynamo_link(local_hashes, ROOT_KEY, False)
        if out is not None:
            return out
    return py_keys_from_local(local_hashes)


def py_keys_from_i64(values: Sequence[Any]) -> list[bytes]:
    """The keys of a request given as Dynamo's signed-i64 local hashes (its
    ``/query_by_hash``), from the root; HashingError naming ``block_hashes[i]`` for an item
    that is not an int in ``-2**63..2**63-1``. Pure Python (the reference of the C path)."""
    local: list[bytes] = []
    for i, h in enumerate(values):
        if type(h) is not int or not -(2**63) <= h < 2**63:
            raise HashingError(f"block_hashes[{i}]: invalid value: {h!r}, expected i64")
        local.append((h % 2**64).to_bytes(8, "big"))
    return py_keys_from_local(local)


def keys_from_i64(values: Sequence[Any]) -> list[bytes]:
    """:func:`py_keys_from_i64`, in C when the extension is loaded (same keys and errors)."""
    if _c is not None:
        out: list[bytes] | None = _c.dynamo_link(values, ROOT_KEY, True)
        if out is not None:
            return out
    return py_keys_from_i64(values)


def _dynamo_raw(tokens: Any, drop_last_token: bool) -> bytes:
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        raw = bytes(tokens)
        if len(raw) % 4:
            raise HashingError(
                f"tokens: packed token ids must be whole u32 values, got {len(raw)} bytes"
            )
        return raw[:-4] if drop_last_token and raw else raw
    return request_raw(tokens, drop_last_token)


def py_dynamo_request_keys(
    tokens: Any,
    tokens_per_block: int,
    lora_name: str | None = None,
    drop_last_token: bool = False,
) -> list[bytes]:
    """The keys of the full blocks of a request: ``tokens`` are its token ids (what
    :func:`~kvstream.hashing.blocks.coerce_tokens` accepts; HashingError for a bad id) or
    their u32 LE bytes (whole ids, else HashingError), without the last one when
    ``drop_last_token``. Pure Python (the reference of the C path)."""
    if tokens_per_block < 1:
        raise HashingError(f"tokens_per_block must be positive, got {tokens_per_block}")
    raw = _dynamo_raw(tokens, drop_last_token)
    step = 4 * tokens_per_block
    end = len(raw) - len(raw) % step
    seed = block_hash_seed(lora_name)
    view = memoryview(raw)
    # local_hash and link_hash inlined, in one loop (see py_keys_from_local)
    xxh3 = _xxh3_be
    key = ROOT_KEY
    out: list[bytes] = []
    append = out.append
    for i in range(0, end, step):
        h = xxh3(view[i : i + step], seed)
        key = xxh3(key + h) + h
        append(key)
    return out


def dynamo_request_keys(
    tokens: Any,
    tokens_per_block: int,
    lora_name: str | None = None,
    drop_last_token: bool = False,
) -> list[bytes]:
    """:func:`py_dynamo_request_keys` in one C call when the extension is loaded (a list of
    ints, e.g. straight from a JSON decoder, or u32 LE bytes); the same keys and errors."""
    if _c is not None:
        seed = LOCAL_HASH_SEED if lora_name is None else block_hash_seed(lora_name)
        out: list[bytes] | None = _c.dynamo_keys(
            tokens, tokens_per_block, seed, ROOT_KEY, drop_last_token
        )
        if out is not None:
            return out
    return py_dynamo_request_keys(tokens, tokens_per_block, lora_name, drop_last_token)

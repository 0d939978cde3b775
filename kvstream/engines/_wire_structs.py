"""msgspec declarations of the vLLM-family ``KVEventBatch`` (map era), for the fast path.

Imported lazily by :mod:`kvstream.engines.vllm`. Decoding into these structs checks every
field's type in C, but for the hash and token arrays: those stay msgpack bytes
(``msgspec.Raw``) that the decoder reads without a Python int per element. A payload that
does not fit (the array era, an unknown tag, a missing or mistyped field, an out-of-range
int) is decoded again by the generic path, which names the problem per event. The union of
every field vLLM and SGLang declare lives in one struct per tag; a field outside it also sends
the payload to the generic path (``forbid_unknown_fields``), which ignores it, as newer engines
add some. msgspec skips an unknown field without looking into it, so a fast path that ignored
one would accept bytes the generic path rejects (invalid UTF-8 in its key or value makes the
payload invalid msgpack): one answer per payload whichever path reads it. Fields with no
kvstream slot are declared ``Any`` so that msgspec still checks what they hold.
"""

from typing import Any

import msgspec

_Hash = int | bytes


class _Event(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, gc=False):
    pass


class Stored(_Event, tag="BlockStored"):
    block_hashes: msgspec.Raw  # list[_Hash], read by the decoder (no Python int per element)
    token_ids: msgspec.Raw  # list[int] (or SGLang's bigram pairs), likewise
    parent_block_hash: _Hash | None = None
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    cache_salt: str | None = None
    # vLLM 0.33 fields kvstream does not read (declared: see the module docstring)
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: Any = None


class Removed(_Event, tag="BlockRemoved"):
    block_hashes: msgspec.Raw
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: Any = None


class Cleared(_Event, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None = None


decode = msgspec.msgpack.Decoder(Batch).decode
ValidationError = msgspec.ValidationError

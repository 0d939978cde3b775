"""Block hashing: the registry of hash algorithms published in events' ``hash_algo``.

::

    from kvstream.hashing import get_hasher
    h = get_hasher("v2_sha256")                       # or get_hasher("vllm_sha256_cbor", seed="0")
    h.chain([[1, 2, 3, 4], [5, 6]])                   # [bytes32, ...]; ints for 64-bit algorithms
    h.chain_bytes(blocks)                             # bytes of width h.width (what events carry)
    h.chain_bytes(blocks, HashScope(cache_salt="t"))  # a request's scope: adapter, salt, ...
    st = h.root(HashScope(cache_salt="t"))            # incremental: one block at a time
    published, st = h.extend(st, block_tokens, mm_keys=())

The scope is also accepted as keywords (``h.chain_bytes(blocks, cache_salt="t")``) and, as
before :class:`HashScope`, positionally (``lora_id, cache_salt, salt_id, lora_name``).

Modules: :mod:`.registry` (names -> factories), :mod:`.base` (the interface, chain state,
scope helpers), :mod:`.scope` (:class:`HashScope`), the algorithms: :mod:`.trtllm`
(TensorRT-LLM), :mod:`.vllm` and :mod:`.vllm_pickle` (vLLM ``sha256_cbor`` and ``sha256``),
:mod:`.sglang`, :mod:`.dynamo`, :mod:`.native` (kvstream's own); :mod:`.salt` (TensorRT-LLM's
salt-id derivations), :mod:`.multimodal` (content digests, mm keys), :mod:`.blocks` (token
containers, request chunking), :mod:`.cbor` (canonical CBOR for vLLM).

Every engine algorithm is checked against vectors computed by the engine's own code
(``tests/data/peers/hash_vectors.json``, written by ``scripts/peers/gen_hash_vectors.py``).
"""

from kvstream.hashing.base import BlockHasher, ChainState, cache_salt_id
from kvstream.hashing.blocks import split_blocks
from kvstream.hashing.multimodal import content_digest
from kvstream.hashing.registry import (
    available_hashers,
    check_hash_algo,
    get_hasher,
    register_hasher,
)
from kvstream.hashing.scope import HashScope

__all__ = [
    "BlockHasher",
    "ChainState",
    "HashScope",
    "available_hashers",
    "cache_salt_id",
    "check_hash_algo",
    "content_digest",
    "get_hasher",
    "register_hasher",
    "split_blocks",
]

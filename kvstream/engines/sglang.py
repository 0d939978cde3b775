"""SGLang's KV events: vLLM's wire format with SGLang's differences (peers.md §2).

SGLang 0.5 copies vLLM's publisher (same ZMQ frames, same replay protocol, tagged msgpack
maps) and differs only in what :class:`~kvstream.engines.vllm.Dialect` captures:

- hashes are signed int64 (the first 8 bytes of its SHA-256 page digest), kvstream's
  ``sglang_sha256_64`` — :func:`~kvstream.engines.vllm.decode_payload` wraps them to the
  unsigned form every other algorithm uses;
- ``BlockStored`` has ``cache_salt`` and ``session_id`` fields and no ``extra_keys`` or
  ``group_idx`` (one layer group), and the batch's rank is the attention-DP rank;
- under EAGLE speculative decoding pages carry bigram token pairs;
- SGLang up to 0.5.19 sent positional arrays: ``[tag, block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium]`` plus, for salted requests, an eighth slot
  ``metadata = {"cache_salt": ...}`` (0.5.20 moved to maps).
"""

from __future__ import annotations

from typing import Final

from kvstream.engines.vllm import Dialect

__all__ = ["SGLANG"]

#: SGLang 0.5.x; its page hash is published as ``sglang_sha256_64``.
SGLANG: Final = Dialect(
    "sglang",
    "sglang_sha256_64",
    bigram_tokens=True,
    stored_positions=(
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "metadata",
    ),
)

"""Hash a request's tokens the way each engine does, and show why the algorithm matters.

Run: python examples/hash_a_request.py
"""

from __future__ import annotations

from kvstream._types import hash_to_hex
from kvstream.hashing import available_hashers, get_hasher, split_blocks


def main() -> None:
    prompt = list(range(1, 13))  # 12 tokens
    tokens_per_block = 4

    # vLLM hashes full blocks only; TensorRT-LLM's router drops the last prompt token and
    # keeps the trailing partial block.
    vllm_blocks = split_blocks(prompt, tokens_per_block)
    trt_router_blocks = split_blocks(
        prompt, tokens_per_block, include_partial=True, drop_last_token=True
    )
    print(f"vLLM blocks:              {[list(b) for b in vllm_blocks]}")
    print(f"TensorRT-LLM router cuts: {[list(b) for b in trt_router_blocks]}")
    print()
    for name in available_hashers():
        hasher = get_hasher(name)
        hashes = hasher.chain_bytes(vllm_blocks)
        print(f"{name:<20} {hasher.width * 8:>3}-bit  first block {hash_to_hex(hashes[0])}")

    # Tenants (cache salt) and LoRA adapters never share blocks.
    h = get_hasher("v2_sha256")
    plain = h.chain_bytes(vllm_blocks)
    salted = h.chain_bytes(vllm_blocks, cache_salt="tenant-a")
    assert not set(plain) & set(salted)
    print("\nsalted and unsalted chains share no block: ok")


if __name__ == "__main__":
    main()

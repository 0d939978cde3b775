"""Several prompts hashed at once: ``BlockHasher.chain_raw_many`` equals ``chain_raw`` per
request (every algorithm, whatever lanes an algorithm hashes side by side), and
``KVCacheManager.hash_prompts`` equals ``hash_prompt`` per prompt, so its results can be
passed to ``add_request(hashed=)``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream._types import TokenIds
from kvstream.cache import CacheConfig, HashedPrompt, KVCacheManager, LayerGroupSpec, RequestError
from kvstream.hashing import available_hashers, get_hasher

_prompts = st.lists(
    st.lists(st.integers(0, 2**32 - 1), max_size=90).map(lambda ids: TokenIds(ids).raw),
    max_size=19,  # more requests than lanes, some with no full block
)


@pytest.mark.parametrize("algo", available_hashers())
@settings(max_examples=25, deadline=None)
@given(raws=_prompts, tpb=st.integers(1, 16))
def test_chain_raw_many_equals_chain_raw(algo: str, raws: list[bytes], tpb: int) -> None:
    hasher = get_hasher(algo)
    root = hasher.root()
    step = 4 * tpb
    want = [hasher.chain_raw(root, raw, tpb, every=len(raw) // step) for raw in raws]
    assert hasher.chain_raw_many(root, raws, tpb) == want


def _manager(algo: str, tpb: int) -> KVCacheManager:
    cfg = CacheConfig(
        tokens_per_block=tpb,
        groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=64)],
        hash_algo=algo,
        metadata_only=True,
    )
    return KVCacheManager(cfg)


def _fields(h: HashedPrompt) -> tuple[object, ...]:
    return (h.raw, h.root, h.hashes, h.chain)  # (HashedPrompt compares by identity)


@pytest.mark.parametrize("algo", ["blake3_64", "vllm_sha256_cbor_64"])
@settings(max_examples=30, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=70), max_size=12),
    tpb=st.integers(1, 8),
)
def test_hash_prompts_equals_hash_prompt(algo: str, prompts: list[list[int]], tpb: int) -> None:
    mgr = _manager(algo, tpb)
    got = mgr.hash_prompts(prompts)
    want = [mgr.hash_prompt(p) for p in prompts]
    assert [_fields(h) for h in got] == [_fields(h) for h in want]
    for i, (p, hashed) in enumerate(zip(prompts, got, strict=True)):
        if mgr.num_free_blocks(0) >= -(-len(p) // tpb):
            mgr.add_request(f"r{i}", p, hashed=hashed)
            assert mgr.block_hashes(f"r{i}") == list(hashed.hashes)
            mgr.free_request(f"r{i}")


def test_hash_prompts_rejects_bad_tokens_first() -> None:
    mgr = _manager("blake3_64", 4)
    with pytest.raises(RequestError):
        mgr.hash_prompts([[1, 2, 3, 4, 5], [-1]])
    with pytest.raises(RequestError):
        mgr.hash_prompts([[]])

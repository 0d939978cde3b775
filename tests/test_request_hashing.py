"""RequestHasher and its prefix cache: always the hashes of split_blocks + chain_bytes.

Properties: for any sequence of requests sharing prefixes (any algorithm, block size, scope,
cache bound and checkpoint spacing) the cached hashes equal the uncached reference; scopes and
hasher parameters never share cache entries; the cache stays within its memory bound; a
fingerprint collision is caught by the byte comparison. Runs with or without the C extension.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.errors import HashingError, UnknownHashAlgorithmError
from kvstream.hashing import get_hasher, split_blocks
from kvstream.hashing import prefix_cache as prefix_cache_mod
from kvstream.hashing.prefix_cache import PrefixCache
from kvstream.index import HashRequest, RequestHasher

ALGOS = [
    "v2_sha256",
    "v2_sha256_64",
    "vllm_sha256_cbor",
    "vllm_sha256_cbor_64",
    "blake3",
    "blake3_64",
    "v1_block_key",
    "vllm_sha256_64",
    "sglang_sha256_64",
    "dynamo_xxh3_64",
]
LORA = {"vllm_sha256_cbor": {"lora_paths": {"ad": "/a"}}}
MIB = 1 << 20


def reference(tokens: Any, algo: str, tpb: int, req: HashRequest, **params: Any) -> list[bytes]:
    blocks = split_blocks(tokens, tpb, drop_last_token=req.drop_last_token)
    return get_hasher(algo, **params).chain_bytes(
        blocks, req.lora_id, req.cache_salt, req.salt_id, lora_name=req.lora_name
    )


def requests_sharing(rng: random.Random, n: int, vocab: int) -> list[list[int]]:
    """Requests built from a few shared prefixes, some repeated, some extended."""
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 200))] for _ in range(3)]
    out: list[list[int]] = []
    for _ in range(n):
        if out and rng.random() < 0.25:
            base = rng.choice(out)
            out.append(base[: rng.randrange(len(base) + 1)] + [rng.randrange(vocab)] * 3)
            continue
        tail = [rng.randrange(vocab) for _ in range(rng.randrange(0, 120))]
        out.append(rng.choice(prefixes) + tail)
    return out


@settings(max_examples=60, deadline=None)
@given(
    algo=st.sampled_from(ALGOS),
    tpb=st.integers(1, 40),
    seed=st.integers(0, 2**32),
    max_bytes=st.sampled_from([0, 3000, 20_000, 1 << 20]),
    checkpoint=st.integers(1, 100),
    drop_last=st.booleans(),
)
def test_cached_equals_reference(  # noqa: PLR0917
    algo: str, tpb: int, seed: int, max_bytes: int, checkpoint: int, drop_last: bool
) -> None:
    rng = random.Random(seed)
    rh = RequestHasher(prefix_cache_bytes=max_bytes, checkpoint_tokens=checkpoint)
    req = HashRequest(drop_last_token=drop_last)
    for tokens in requests_sharing(rng, 12, rng.choice([30, 300, 200_000, 2**32])):
        assert rh.hashes(tokens, algo, tpb, req) == reference(tokens, algo, tpb, req)
    stats = rh.prefix_cache.stats()
    assert stats.bytes <= max_bytes
    assert stats.hits + stats.misses == 12


def test_recurring_prompt_is_hashed_once() -> None:
    rng = random.Random(1)
    system = [rng.randrange(128_000) for _ in range(4096)]
    rh = RequestHasher(prefix_cache_bytes=MIB, checkpoint_tokens=256)
    reqs = [system + [rng.randrange(128_000) for _ in range(100)] for _ in range(5)]
    for tokens in reqs:
        assert rh.hashes(tokens, "vllm_sha256_cbor_64", 16) == reference(
            tokens, "vllm_sha256_cbor_64", 16, HashRequest()
        )
    s = rh.prefix_cache.stats()
    # the first request is only remembered (admission), the second is cached, then hits
    assert (s.hits, s.misses, s.entries) == (3, 2, 4)
    assert s.reused_blocks == 3 * 256  # the whole 4096-token prompt
    assert s.hashed_blocks == 5 * 262 - s.reused_blocks
    # any of them again: nothing hashed
    for tokens in (reqs[-1], reqs[1]):  # (reqs[0] was never cached)
        assert rh.hashes(tokens, "vllm_sha256_cbor_64", 16) == reference(
            tokens, "vllm_sha256_cbor_64", 16, HashRequest()
        )
    assert rh.prefix_cache.stats().hashed_blocks == s.hashed_blocks
    # a shorter prefix of one: reused up to its last checkpoint (3999 tokens: 249 blocks, 240)
    tokens = reqs[2][:4000]
    assert rh.hashes(tokens, "vllm_sha256_cbor_64", 16) == reference(
        tokens, "vllm_sha256_cbor_64", 16, HashRequest()
    )
    assert rh.prefix_cache.stats().hashed_blocks == s.hashed_blocks + 9


@pytest.mark.parametrize("algo", ["vllm_sha256_cbor", "v2_sha256", "blake3", "v1_block_key"])
def test_scopes_never_share_entries(algo: str) -> None:
    tokens = list(range(1000, 1600))
    if algo.startswith("vllm"):
        scopes = [HashRequest(), HashRequest(cache_salt="a"), HashRequest(lora_name="ad")]
        scopes.append(HashRequest(lora_name="ad", cache_salt="a"))
    else:
        scopes = [HashRequest(), HashRequest(salt_id=1), HashRequest(lora_id=2)]
        scopes.append(HashRequest(lora_id=2, salt_id=1))
    rh = RequestHasher(LORA, prefix_cache_bytes=MIB, checkpoint_tokens=16)
    seen = set()
    for _ in range(2):
        for req in scopes:
            got = rh.hashes(tokens, algo, 16, req)
            assert got == reference(tokens, algo, 16, req, **LORA.get(algo, {}))
            seen.add(got[0])
    assert len(seen) == len(scopes)


def test_hasher_params_never_share_entries() -> None:
    tokens = list(range(500))
    a = RequestHasher(
        {"vllm_sha256_cbor": {"seed": "0"}}, prefix_cache_bytes=MIB, checkpoint_tokens=32
    )
    b = RequestHasher(prefix_cache_bytes=MIB, checkpoint_tokens=32)
    assert a.hashes(tokens, "vllm_sha256_cbor", 16) == reference(
        tokens, "vllm_sha256_cbor", 16, HashRequest(), seed="0"
    )
    assert b.hashes(tokens, "vllm_sha256_cbor", 16) != a.hashes(tokens, "vllm_sha256_cbor", 16)
    # one cache shared by two hashers of the same name with different parameters
    cache = PrefixCache(checkpoint_tokens=32)
    raw = b"".join(t.raw for t in split_blocks(tokens, 1))
    for params in ({"seed": "0"}, {}, {"seed": "0"}):
        h = get_hasher("vllm_sha256_cbor", **params)
        assert cache.chain(h, h.root(), raw, 16) == h.chain_bytes(split_blocks(tokens, 16))


def test_fingerprint_collisions_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prefix fingerprints alike: the byte comparison still keeps requests apart."""

    def constant(raw: bytes, stride: int, whole: bool = False) -> list[int]:
        return [7] * (len(raw) // stride + (1 if whole and len(raw) % stride else 0))

    monkeypatch.setattr(prefix_cache_mod, "fingerprints", constant)
    rh = RequestHasher(prefix_cache_bytes=MIB, checkpoint_tokens=8)
    rng = random.Random(3)
    for tokens in requests_sharing(rng, 20, 50):
        assert rh.hashes(tokens, "v2_sha256", 4) == reference(tokens, "v2_sha256", 4, HashRequest())


def test_memory_bound_evicts_least_recently_used() -> None:
    rh = RequestHasher(prefix_cache_bytes=200_000, checkpoint_tokens=64)
    rng = random.Random(5)
    reqs = [[rng.randrange(1000) for _ in range(2000)] for _ in range(30)]
    for tokens in reqs:
        rh.hashes(tokens, "blake3", 32)
    assert rh.prefix_cache.stats().entries == 0  # one-off requests are not admitted
    for tokens in reqs:
        rh.hashes(tokens, "blake3", 32)  # seen before: cached
    s = rh.prefix_cache.stats()
    assert 0 < s.entries < 30
    assert s.bytes <= 200_000
    # the newest request is cached (no hashing), the oldest one was evicted
    before = rh.prefix_cache.stats().hashed_blocks
    rh.hashes(reqs[-1], "blake3", 32)
    assert rh.prefix_cache.stats().hashed_blocks == before
    rh.hashes(reqs[0], "blake3", 32)
    assert rh.prefix_cache.stats().hashed_blocks > before
    rh.prefix_cache.clear()
    assert rh.prefix_cache.stats().entries == 0
    # a request larger than the bound is hashed, not cached
    small = RequestHasher(prefix_cache_bytes=1000, checkpoint_tokens=4)
    for _ in range(2):
        assert small.hashes(reqs[0], "blake3", 4) == reference(reqs[0], "blake3", 4, HashRequest())
    assert small.prefix_cache.stats().entries == 0


def test_inputs_and_errors() -> None:
    assert RequestHasher().prefix_cache.max_bytes == 0  # opt-in
    rh = RequestHasher(prefix_cache_bytes=MIB)
    tokens = list(range(100))
    want = reference(tokens, "v2_sha256", 8, HashRequest())
    import numpy as np

    from kvstream._types import TokenIds

    for form in (tokens, tuple(tokens), np.array(tokens), TokenIds(tokens), range(100)):
        assert rh.hashes(form, "v2_sha256", 8) == want
    assert rh.hashes([], "v2_sha256", 8) == []
    with pytest.raises(HashingError, match=r"tokens\[3\] = -1"):
        rh.hashes([1, 2, 3, -1], "v2_sha256", 2)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(HashingError, match="tokens_per_block"):
            rh.hashes(tokens, "v2_sha256", bad)  # type: ignore[arg-type]
    with pytest.raises(UnknownHashAlgorithmError):
        rh.hashes(tokens, "nope", 8)
    with pytest.raises(HashingError, match="salt_id"):
        rh.hashes(tokens, "vllm_sha256_cbor", 8, HashRequest(salt_id=3))
    with pytest.raises(HashingError, match="max_bytes"):
        PrefixCache(-1)
    with pytest.raises(HashingError, match="checkpoint_tokens"):
        PrefixCache(checkpoint_tokens=0)


def test_multimodal_requests_bypass_the_cache() -> None:
    from blake3 import blake3

    digest = blake3(b"image").digest()
    rh = RequestHasher(prefix_cache_bytes=MIB, checkpoint_tokens=4)
    tokens = list(range(40))
    plain = rh.hashes(tokens, "v2_sha256", 4)
    with_image = rh.hashes(tokens, "v2_sha256", 4, HashRequest(mm_keys=(((digest, 0),),)))
    assert with_image[0] != plain[0]
    assert with_image[1:] != plain[1:]
    assert rh.hashes(tokens, "v2_sha256", 4) == plain

"""kvstream.hashing: reference vectors, the registry, request scope, multimodal keys, errors.

Vectors come from tests/data/block_hashes.json (loaded, never copied) and from the reference
notes (TensorRT-LLM §3.4, vLLM §1.4). Property tests live in test_hashing_properties.py.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
from blake3 import blake3
from v1_vectors import DIGEST, V1_CHAINS

from kvstream._types import BLOCK_HASH_WIDTHS, TokenIds, hash_from_int
from kvstream.errors import HashingError, KVStreamError, UnknownHashAlgorithmError
from kvstream.hashing import (
    BlockHasher,
    ChainState,
    available_hashers,
    cache_salt_id,
    content_digest,
    get_hasher,
    register_hasher,
    split_blocks,
)
from kvstream.hashing import registry as registry_mod
from kvstream.hashing.native import STRUCTURED_CONTEXT

DATA = json.loads((Path(__file__).parent / "data" / "block_hashes.json").read_text())
CASES = DATA["cases"]
#: Case params that configure the algorithm (get_hasher kwargs); the rest are request scope.
ALGO_PARAMS = {"seed", "extra_keys", "lora_paths"}
BUILTIN = [
    "blake3",
    "blake3_64",
    "v1_block_key",
    "v2_sha256",
    "v2_sha256_64",
    "vllm_sha256_cbor",
    "vllm_sha256_cbor_64",
]


def fold(h: BlockHasher, blocks: list[Any], **scope: Any) -> list[bytes]:
    """The chain via root() + extend(), as published bytes."""
    mm = scope.pop("mm_keys", None)
    extra = scope.pop("token_extra_ids", None)
    st = h.root(**scope)
    out = []
    for i, b in enumerate(blocks):
        pub, st = h.extend(st, b, mm[i] if mm else (), extra[i] if extra is not None else None)
        out.append(pub)
    return out


def as_expected(h: BlockHasher, values: list[bytes]) -> list[Any]:
    """Published bytes in the JSON vectors' form: ints for 64-bit, hex for 256-bit."""
    if h.width == 8:
        return [int.from_bytes(v, "big") for v in values]
    return [v.hex() for v in values]


# --------------------------------------------------------------------------- JSON vectors


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_reference_vectors(case: dict[str, Any]) -> None:
    params = dict(case.get("params", {}))
    algo_params = {k: params.pop(k) for k in list(params) if k in ALGO_PARAMS}
    h = get_hasher(case["algo"], **algo_params)
    chained = h.chain(case["blocks"], **params)
    if h.width == 8:
        assert chained == case["expect"]
    else:
        assert [c.hex() for c in cast("list[bytes]", chained)] == case["expect"]
    assert as_expected(h, h.chain_bytes(case["blocks"], **params)) == case["expect"]
    assert as_expected(h, fold(h, case["blocks"], **params)) == case["expect"]


def test_vector_file_covers_every_published_algorithm() -> None:
    assert {c["algo"] for c in CASES} <= set(BUILTIN)
    assert set(DATA["definitions"]) <= set(BUILTIN)


# ------------------------------------------------------- TensorRT-LLM §3.4 extra vectors


@pytest.mark.parametrize(
    ("blocks", "kwargs", "expect"),
    [c[1:] for c in V1_CHAINS],
    ids=[c[0] for c in V1_CHAINS],
)
def test_v1_block_key_vectors(blocks: list[Any], kwargs: dict[str, Any], expect: list[int]) -> None:
    h = get_hasher("v1_block_key")
    assert h.chain(blocks, **kwargs) == expect
    assert [int.from_bytes(b, "big") for b in fold(h, blocks, **kwargs)] == expect


def test_v1_signed_wire_form_and_salt_ids() -> None:
    h = get_hasher("v1_block_key")
    c = h.chain_bytes([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    assert hash_from_int(-8435037056603654627) == c[2]  # C3 as the signed int64 wire form
    # F' : BLAKE3(salt)[:8] little-endian, the default (TensorRT-LLM's get_cache_salt_id);
    # F: SHA-256, the V2 manager's derivation.
    assert cache_salt_id("tenant-A") == 11905099046384790080
    assert int.from_bytes(blake3(b"tenant-A").digest()[:8], "little") == 11905099046384790080
    assert cache_salt_id("tenant-A", "sha256") == 10590430051267512242
    assert cache_salt_id("", "sha256") == 1449310910991872227


V2_ROOT_EMPTY = "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
V2_CHAINS = [
    # (id, blocks, kwargs, v2_sha256 hex keys (full or prefix), v2_sha256_64 values or None)
    (
        "B",
        [[1, 2, 3, 4], [5, 6]],
        {},
        ["e4322285", "7fabfb79be197b116ecec3a823a33b6cf1597e2d2a662f43165da8d2c118116d"],
        [16443243144690205867, 9199723164133325585],
    ),
    (
        "D",
        [[1, 2, 3, 4], [5, 6]],
        {"salt_id": 123},
        [
            "937fe4b3be3255ef678804615952c55a3912a483d031e796a7faaea4d36db9ec",
            "8034a44865445bc6b9ccc1e7d28ff79db3f7f2d0a678ffee07fc95c5b347c893",
        ],
        [10628465106258908655, 9238189366487309254],
    ),
    (
        "E",
        [[1, 2, 3, 4]],
        {"lora_id": 7},
        ["7e4ad4f8cb28400cd4c606251584643a4fb654d50f1bed85f967ec55f8b76946"],
        [9100320162080899084],
    ),
    (
        "F",
        [[1, 2, 3, 4]],
        {"lora_id": 11, "salt_id": 22},
        ["9ce53dbd9b6407b55bee59c64b3d66d4e94fd5504f34092eaf0371849a28dd6f"],
        [11305510324148635573],
    ),
    (
        "G",
        [[1, 2, 3, 4], [5, 6, 7, 8]],
        {"cache_salt": "tenant-A"},
        [
            "04c716d2b35c97b0f9582d728a27ff53edd93fafa765ed110fcfe73277707df0",
            "2c39f1fbb4352bd9b51042b49656ba7fb4bb964b08984763b0ec93bf01efb59a",
        ],
        [344268990725265328, 3186844274703805401],
    ),
    (
        "H",
        [[DIGEST, 1001, 1002, 1003]],
        {},
        ["a9c37f0e9dc090e0fe39a3a767054abf95e737a4240a2e4d7e6f9c1fffa2c735"],
        [12232760713621311712],
    ),
    (
        "I",
        [[0, 1, 2, 3], [4, 5, 6, 7]],
        {},
        [
            "7b894451a88bc03088bd0c44f01139922b089a1ab691d157c273185c78ca83b2",
            "181684b4f09a9fc1689624a565bc5c9ed96cede3e0863cf373463b1a93c45369",
        ],
        [8901721255985266736, 1735720619063549889],
    ),
]


@pytest.mark.parametrize(
    ("blocks", "kwargs", "keys", "u64"), [c[1:] for c in V2_CHAINS], ids=[c[0] for c in V2_CHAINS]
)
def test_v2_vectors(
    blocks: list[Any], kwargs: dict[str, Any], keys: list[str], u64: list[int]
) -> None:
    h = get_hasher("v2_sha256")
    got = [k.hex() for k in h.chain(blocks, **kwargs)]  # type: ignore[union-attr]
    assert len(got) == len(keys)
    for g, k in zip(got, keys, strict=True):
        assert g.startswith(k)
    assert [k.hex() for k in fold(h, blocks, **kwargs)] == got
    assert get_hasher("v2_sha256_64").chain(blocks, **kwargs) == u64


def test_v2_root_and_scope_bytes() -> None:
    from kvstream.hashing.base import scope_bytes

    h = get_hasher("v2_sha256")
    assert h.root().key.hex() == V2_ROOT_EMPTY
    assert scope_bytes(None, 123).hex() == "027b00000000000000"
    assert h.root(salt_id=123).key.hex().startswith("18027f2e")
    assert h.root(salt_id=123).key.hex().endswith("279b")
    assert scope_bytes(7, None).hex() == "010700000000000000"
    assert scope_bytes(11, 22).hex() == "030b000000000000001600000000000000"
    assert scope_bytes(None, cache_salt_id("tenant-A", "sha256")).hex() == "02b2076c6805c4f892"


def test_v2_mm_keys_are_appended_digest_and_offset() -> None:
    h = get_hasher("v2_sha256")
    root = h.root().key
    want = hashlib.sha256(
        root + array("I", [9, 9, 9, 9]).tobytes() + DIGEST + (3).to_bytes(4, "little")
    ).digest()
    assert h.chain([[9, 9, 9, 9]], mm_keys=[[(DIGEST, 3)]]) == [want]


@pytest.mark.parametrize(
    ("tokens", "expect"),
    [
        (list(range(1, 10)), [924206229973855, 2728178455351807326]),
        (list(range(1, 8)), [924206229973855, 6875034662206558884]),
    ],
    ids=["1..9", "1..7"],
)
def test_router_chunking_rule(tokens: list[int], expect: list[int]) -> None:
    blocks = split_blocks(tokens, 4, drop_last_token=True, include_partial=True)
    assert get_hasher("v1_block_key").chain(blocks) == expect


# ------------------------------------------------------------------ vLLM §1.4 vectors

SEED = "vllm-none-hash"
V3 = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]


def _vllm(width: int = 32, **params: Any) -> BlockHasher:
    return get_hasher("vllm_sha256_cbor" if width == 32 else "vllm_sha256_cbor_64", **params)


def test_vllm_none_hash_v1_v2() -> None:
    v1 = _vllm(seed=SEED)
    assert v1.root().key.hex() == (
        "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    )
    assert int.from_bytes(v1.root().key[-8:], "big") == 10672167085007826672
    v2 = _vllm(seed="0")
    assert v2.root().key.hex() == (
        "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    )
    assert int.from_bytes(v2.root().key[-8:], "big") == 17921330210090130494
    assert _vllm().root().key == v1.root().key  # the default seed


def test_vllm_v3_payload_is_canonical_cbor() -> None:
    import cbor2

    h = _vllm()
    none_hash = h.root().key
    payload = cbor2.dumps((none_hash, (1, 2, 3, 4), None), canonical=True)
    assert payload.hex() == "835820" + none_hash.hex() + "8401020304f6"
    assert h.chain([[1, 2, 3, 4]]) == [hashlib.sha256(payload).digest()]


VLLM_U64 = [
    (
        "V4",
        {"seed": "0"},
        V3,
        {},
        [2164874634404590027, 17270480062156288726, 15775340307203827378],
    ),
    ("V5", {}, [list(range(16))], {}, [2233398808101521225]),
    ("V6", {}, V3[:2], {"cache_salt": "s1"}, [13058387990771713016, 6674538477739822157]),
    (
        "V6-legacy",
        {"extra_keys": "legacy"},
        V3[:2],
        {"cache_salt": "s1"},
        [879847350859827656, 11172635667609733632],
    ),
    (
        "V7",
        {},
        V3[:2],
        {"lora_name": "my-lora", "lora_path": "/path/a"},
        [16537919963371065481, 12412203374614132201],
    ),
    (
        "V7-lora-paths",
        {"lora_paths": {"my-lora": "/path/a"}},
        V3[:2],
        {"lora_name": "my-lora"},
        [16537919963371065481, 12412203374614132201],
    ),
    (
        "V7-legacy",
        {"extra_keys": "legacy"},
        V3[:2],
        {"lora_name": "my-lora"},
        [12610926233750375601, 17914138962050406310],
    ),
    ("V8", {}, [[1, 2, 3, 4]], {"mm_keys": [[("abc123", 0)]]}, [950250269817426445]),
]


@pytest.mark.parametrize(
    ("params", "blocks", "kwargs", "expect"),
    [c[1:] for c in VLLM_U64],
    ids=[c[0] for c in VLLM_U64],
)
def test_vllm_vectors(
    params: dict[str, Any], blocks: list[Any], kwargs: dict[str, Any], expect: list[int]
) -> None:
    h64 = _vllm(8, **params)
    assert h64.chain(blocks, **kwargs) == expect
    assert [int.from_bytes(b, "big") for b in fold(h64, blocks, **dict(kwargs))] == expect
    # the 64-bit form is the last 8 bytes of the 256-bit digest
    full = _vllm(32, **params).chain_bytes(blocks, **kwargs)
    assert [int.from_bytes(d[-8:], "big") for d in full] == expect


VLLM_DIGESTS = [
    (
        "V5",
        [list(range(16))],
        {},
        ["dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"],
    ),
    (
        "V6",
        V3[:2],
        {"cache_salt": "s1"},
        [
            "6b34eefae052446391748e3de039648a84a16ca73963c333b538b6b0f92cc3f8",
            "e2a1309181878ea2dded25aa08f92264a89eb4ad4c42c4c95ca0b961dd5bcc4d",
        ],
    ),
    (
        "V8",
        [[1, 2, 3, 4]],
        {"mm_keys": [[("abc123", 0)]]},
        ["d8c9ed5a346abdbed5cf5d089dbfd152b220620f273673820d2ff795f42fd20d"],
    ),
]


@pytest.mark.parametrize(
    ("blocks", "kwargs", "expect"), [c[1:] for c in VLLM_DIGESTS], ids=[c[0] for c in VLLM_DIGESTS]
)
def test_vllm_digest_vectors(blocks: list[Any], kwargs: dict[str, Any], expect: list[str]) -> None:
    assert [d.hex() for d in _vllm().chain_bytes(blocks, **kwargs)] == expect


def test_vllm_mm_bytes_identifier_is_hex() -> None:
    h = _vllm()
    assert h.chain([[1, 2, 3, 4]], mm_keys=[[(DIGEST, 0)]]) == h.chain(
        [[1, 2, 3, 4]], mm_keys=[[(DIGEST.hex(), 0)]]
    )


def test_vllm_seed_is_explicit_not_read_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _vllm().root().key
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert _vllm().root().key == before
    assert _vllm(seed="0").root().key != before


# -------------------------------------------------------------------- blake3 (native)

B3_EMPTY_ROOT = "2d3adedff11b61f14c886e35afa036736dcd87a74d27b5c1510225d0f592e213"
B3_PINNED = [
    (
        "chain",
        [[1, 2, 3, 4], [5, 6, 7, 8]],
        {},
        [
            "133c9e2c7b7a372167d83b80df805360137e47d1ffbe62e8b5969295c8168d2a",
            "dffacb2034d78f413a743074909585318eaeb2a1523973f8f644bbc2c7d1aeea",
        ],
    ),
    (
        "lora",
        [[1, 2, 3, 4]],
        {"lora_id": 7},
        ["7c8587a03f434bae993dcee3c01eb42c590d0658a0fd4de7234814eff561c767"],
    ),
    (
        "salt",
        [[1, 2, 3, 4]],
        {"cache_salt": "tenant-A"},
        ["02a17fa6e010119944727346250c2bd11ec002560e6dc22d303d9c18a87cc7a4"],
    ),
    (
        "mm-key",
        [[1, 2, 3, 4]],
        {"mm_keys": [[(DIGEST, 2)]]},
        ["fa4a7308a08ae8a0c7c3568afc9bebfe54c28d039910dbc66e630ead265f48bf"],
    ),
    (
        "digest-token",
        [[DIGEST, 1001, 1002, 1003]],
        {},
        ["5e5e4241a9b1a1fca75f178d964ea1dca4b2f2f254e828fbc816362cfb4f344f"],
    ),
    (
        "extra-ids",
        [[1, 2, 3, 4]],
        {"token_extra_ids": [[7, 0, 0, 9]]},
        ["8469dc8c9c653dd993b9caf654cb86fc951f6e935b6f7adac9625ff1feb8eef2"],
    ),
]


@pytest.mark.parametrize(
    ("blocks", "kwargs", "expect"), [c[1:] for c in B3_PINNED], ids=[c[0] for c in B3_PINNED]
)
def test_blake3_pinned_vectors(
    blocks: list[Any], kwargs: dict[str, Any], expect: list[str]
) -> None:
    h = get_hasher("blake3")
    assert [k.hex() for k in h.chain_bytes(blocks, **kwargs)] == expect
    assert [k.hex() for k in fold(h, blocks, **kwargs)] == expect
    assert get_hasher("blake3_64").chain(blocks, **kwargs) == [int(e[:16], 16) for e in expect]


def test_blake3_matches_its_documented_definition() -> None:
    h = get_hasher("blake3")
    root = blake3(b"\x00").digest()
    assert root.hex() == B3_EMPTY_ROOT == h.root().key.hex()
    k1 = blake3(root + array("I", [1, 2, 3, 4]).tobytes()).digest()
    k2 = blake3(k1 + array("I", [5, 6, 7, 8]).tobytes()).digest()
    assert h.chain([[1, 2, 3, 4], [5, 6, 7, 8]]) == [k1, k2]
    scoped = blake3(b"\x03" + (5).to_bytes(8, "little") + (9).to_bytes(8, "little")).digest()
    assert h.root(lora_id=5, salt_id=9).key == scoped

    def u32(n: int) -> bytes:
        return n.to_bytes(4, "little")

    structured = blake3(
        root
        + u32(3)
        + array("I", [1001, 1002, 1003]).tobytes()
        + u32(1)
        + u32(0)
        + DIGEST
        + u32(1)
        + DIGEST[::-1]
        + u32(5)
        + u32(0),
        derive_key_context=STRUCTURED_CONTEXT,
    ).digest()
    assert h.chain([[DIGEST, 1001, 1002, 1003]], mm_keys=[[(DIGEST[::-1], 5)]]) == [structured]


# ---------------------------------------------------------------- registry and widths


def test_available_hashers_lists_the_builtins() -> None:
    assert set(BUILTIN) <= set(available_hashers())
    assert available_hashers() == sorted(available_hashers())


@pytest.mark.parametrize("name", BUILTIN)
def test_width_matches_published_widths(name: str) -> None:
    h = get_hasher(name)
    assert isinstance(h, BlockHasher)
    assert h.name == name
    assert h.width == BLOCK_HASH_WIDTHS[name]
    blocks = [[1, 2, 3, 4], [5, 6, 7, 8], [9]]
    published = h.chain_bytes(blocks)
    assert all(type(p) is bytes and len(p) == h.width for p in published)
    chained = h.chain(blocks)
    if h.width == 8:
        assert all(type(c) is int and 0 <= c < 2**64 for c in chained)
        assert [c.to_bytes(8, "big") for c in chained] == published  # type: ignore[union-attr]
    else:
        assert chained == published


def test_unknown_algorithm_lists_known_names() -> None:
    with pytest.raises(UnknownHashAlgorithmError) as info:
        get_hasher("md5_of_vibes")
    err = info.value
    assert isinstance(err, HashingError)
    assert isinstance(err, KeyError)
    assert isinstance(err, KVStreamError)
    for name in BUILTIN:
        assert name in str(err)
    assert "md5_of_vibes" in str(err)


def test_bad_algorithm_params() -> None:
    with pytest.raises(TypeError):
        get_hasher("v2_sha256", seed="x")
    with pytest.raises(TypeError):
        get_hasher("vllm_sha256_cbor", sead="x")
    with pytest.raises(HashingError, match="seed must be a str"):
        get_hasher("vllm_sha256_cbor", seed=0)
    with pytest.raises(HashingError, match="extra_keys"):
        get_hasher("vllm_sha256_cbor", extra_keys="v0.18")


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a test register hashers without leaking them into other tests."""
    monkeypatch.setattr(registry_mod, "_FACTORIES", dict(registry_mod._FACTORIES))


class _Sha1Hasher(BlockHasher):
    """A toy third-party algorithm: SHA-1 chain, 32-byte published (zero padded)."""

    width = 32

    def __init__(self, name: str = "toy_sha1") -> None:
        self.name = name

    def root(self, lora_id=None, cache_salt=None, salt_id=None, lora_name=None, *, lora_path=None):  # type: ignore[no-untyped-def]
        return ChainState(self.name, b"", 0, ())

    def extend(self, state, block_tokens, mm_keys=(), token_extra_ids=None):  # type: ignore[no-untyped-def]
        key = hashlib.sha1(state.key + bytes(TokenIds(block_tokens).raw)).digest().ljust(32, b"\0")
        return key, ChainState(self.name, key, state.depth + 1, ())


@pytest.mark.usefixtures("scratch_registry")
def test_register_third_party_hasher() -> None:
    register_hasher("toy_sha1", _Sha1Hasher)
    assert "toy_sha1" in available_hashers()
    h = get_hasher("toy_sha1")
    assert len(h.chain([[1, 2], [3]])) == 2
    with pytest.raises(HashingError, match="already registered"):
        register_hasher("toy_sha1", _Sha1Hasher)
    register_hasher("toy_sha1", _Sha1Hasher, replace=True)
    with pytest.raises(HashingError, match="already registered"):
        register_hasher("v2_sha256", _Sha1Hasher)


@pytest.mark.usefixtures("scratch_registry")
def test_register_checks_name_and_width() -> None:
    register_hasher("toy_misnamed", lambda: _Sha1Hasher("other"))
    with pytest.raises(HashingError, match="named 'other'"):
        get_hasher("toy_misnamed")
    register_hasher("v1_block_key", lambda: _Sha1Hasher("v1_block_key"), replace=True)
    with pytest.raises(HashingError, match="width 32"):
        get_hasher("v1_block_key")
    with pytest.raises(HashingError):
        register_hasher("", _Sha1Hasher)
    with pytest.raises(HashingError):
        register_hasher("toy", "not callable")  # type: ignore[arg-type]


# ----------------------------------------------------- scope and multimodal separation


def lora(name: str, which: int) -> dict[str, Any]:
    """Request kwargs naming LoRA adapter ``which`` in the form ``name`` hashes."""
    if name.startswith("vllm"):
        return {"lora_name": f"adapter-{which}", "lora_path": f"/adapters/{which}"}
    return {"lora_id": which}


BLOCKS = [[11, 12, 13, 14], [15, 16, 17, 18], [19, 20]]


@pytest.mark.parametrize("name", BUILTIN)
def test_lora_and_salt_separate_every_block(name: str) -> None:
    h = get_hasher(name)
    variants = {
        "plain": {},
        "lora1": lora(name, 1),
        "lora2": lora(name, 2),
        "lora0": lora(name, 0),
        "saltA": {"cache_salt": "A"},
        "saltB": {"cache_salt": "B"},
        "lora1+saltA": {**lora(name, 1), "cache_salt": "A"},
    }
    if not name.startswith("vllm"):  # vLLM ignores an empty salt (see below)
        variants["salt-empty"] = {"cache_salt": ""}
    chains = {k: h.chain_bytes(BLOCKS, **kw) for k, kw in variants.items()}
    for i in range(len(BLOCKS)):
        column = [c[i] for c in chains.values()]
        assert len(set(column)) == len(column), f"block {i} collides across scopes"
    if name.startswith("vllm"):
        assert h.chain_bytes(BLOCKS, cache_salt="") == chains["plain"]
    else:
        salt_hash = getattr(h, "salt_hash", "sha256")
        assert h.chain_bytes(BLOCKS, cache_salt="A") == h.chain_bytes(
            BLOCKS, salt_id=cache_salt_id("A", salt_hash)
        )


@pytest.mark.parametrize("name", BUILTIN)
def test_two_images_behind_the_same_placeholder_differ(name: str) -> None:
    h = get_hasher(name)
    placeholder = [[7, 99, 99, 99], [99, 99, 8, 9]]
    img_a, img_b = content_digest(b"image A"), content_digest(b"image B")
    img_a_uuid = content_digest(b"image A", uuid="req-1/img-0")

    def run(img: bytes | None, offsets: tuple[int, int] = (0, 3)) -> list[bytes]:
        if img is None:
            return h.chain_bytes(placeholder)
        return h.chain_bytes(placeholder, mm_keys=[[(img, offsets[0])], [(img, offsets[1])]])

    chains = [run(None), run(img_a), run(img_b), run(img_a_uuid), run(img_a, (1, 3))]
    for i in range(len(placeholder)):
        column = [c[i] for c in chains]
        assert len(set(column)) == len(column), f"block {i}: images/offsets collide"
    assert run(img_a) == run(img_a)


@pytest.mark.parametrize("name", BUILTIN)
def test_mm_key_forms_are_equivalent(name: str) -> None:
    h = get_hasher(name)
    img = content_digest(b"pixels")
    as_tuple = h.chain_bytes([[5, 5, 5]], mm_keys=[[(img, 1)]])
    as_object = h.chain_bytes(
        [[5, 5, 5]], mm_keys=[[SimpleNamespace(hash=img, start_offset=1, uuid="u")]]
    )
    as_hex = h.chain_bytes([[5, 5, 5]], mm_keys=[[(img.hex(), 1)]])
    assert as_tuple == as_object == as_hex
    plain = h.extend(h.root(), [5, 5, 5])[0]
    for empty in ((), [], None, iter([])):
        assert h.extend(h.root(), [5, 5, 5], empty)[0] == plain
    assert h.chain_bytes([[5, 5, 5]], mm_keys=[None]) == [plain]


def test_content_digest() -> None:
    data = b"\x89PNG fake image bytes"
    assert content_digest(data) == blake3(data).digest()
    framed = b"<uuid>" + b"frontend-h-a" + b"</uuid><content>" + data + b"</content>"
    assert content_digest(data, uuid="frontend-h-a") == blake3(framed).digest()
    assert content_digest(bytearray(data)) == content_digest(memoryview(data))
    assert content_digest(data, uuid="a") != content_digest(data, uuid="b")
    assert len(content_digest(b"")) == 32
    with pytest.raises(HashingError):
        content_digest("text")  # type: ignore[arg-type]
    with pytest.raises(HashingError):
        content_digest(data, uuid=5)  # type: ignore[arg-type]


# ------------------------------------------------------------------ inputs and state


TOKENS = [1, 70000, 3, 4_000_000_000, 255, 256, 23, 24, 65535, 65536, 0, 2**32 - 1, 42, 128000]


@pytest.mark.parametrize("name", BUILTIN)
def test_accepted_input_types_are_equal(name: str) -> None:
    h = get_hasher(name)
    blocks = [TOKENS[:7], TOKENS[7:]]
    want = h.chain_bytes(blocks)
    forms: list[Iterable[Any]] = [
        [tuple(b) for b in blocks],
        [array("I", b) for b in blocks],
        [TokenIds(b) for b in blocks],
        [np.array(b, dtype=np.int64) for b in blocks],
        [np.array(b, dtype=np.uint32) for b in blocks],
        (list(b) for b in blocks),  # any iterable of blocks
    ]
    for form in forms:
        assert h.chain_bytes(form) == want
    assert h.chain_bytes([range(1, 5), range(5, 9)]) == h.chain_bytes([[1, 2, 3, 4], [5, 6, 7, 8]])
    st = h.root()
    for b, w in zip([TokenIds(blocks[0]), array("I", blocks[1])], want, strict=True):
        pub, st = h.extend(st, b)
        assert pub == w


@pytest.mark.parametrize("name", BUILTIN)
def test_chain_states_are_immutable_and_branch(name: str) -> None:
    h = get_hasher(name)
    st0 = h.root()
    _, st1 = h.extend(st0, [1, 2, 3, 4])
    a, _ = h.extend(st1, [5, 6, 7, 8])
    b, _ = h.extend(st1, [5, 6, 7, 9])
    assert [a] == h.chain_bytes([[1, 2, 3, 4], [5, 6, 7, 8]])[1:]
    assert [b] == h.chain_bytes([[1, 2, 3, 4], [5, 6, 7, 9]])[1:]
    assert st1.depth == 1
    assert st0 == h.root()
    with pytest.raises(AttributeError):
        st1.key = b""  # type: ignore[misc]


@pytest.mark.parametrize("name", BUILTIN)
def test_long_requests_take_the_vectorised_paths(name: str) -> None:
    """>= 512 tokens: vLLM's numpy CBOR path and v1's numpy mix path agree with extend()."""
    rng = np.random.default_rng(7)
    blocks = [rng.integers(0, 2**32, 16, dtype=np.uint64).tolist() for _ in range(40)]
    blocks += [rng.integers(0, 300_000, 16).tolist() for _ in range(40)]
    mm = [[(content_digest(bytes([i])), i)] if i % 7 == 3 else [] for i in range(len(blocks))]
    scope = {**lora(name, 3), "cache_salt": "tenant"}
    h = get_hasher(name)
    for kw in ({}, scope, {"mm_keys": mm}, {**scope, "mm_keys": mm}):
        assert h.chain_bytes(blocks, **kw) == fold(h, blocks, **kw)


# ------------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.parametrize(
    ("block", "match"),
    [
        ([1, -1, 3], r"\[1\] = -1: token ids must be in 0..4294967295"),
        ([2**32], r"4294967296: token ids must be in"),
        ((1, 2.5), r"\[1\] = 2.5: token ids must be ints"),
        ([1, "2"], "token ids must be ints"),
        ([], "at least one token"),
        (np.array([1, -2]), r"\[1\] = -2"),
        (np.zeros((2, 2), dtype=np.int64), "1-D integer array"),
        (b"\x01\x00\x00\x00", "sequence of token ids"),
        ("1234", "sequence of token ids"),
        (7, "sequence of token ids"),
    ],
    ids=[
        "negative",
        "too-big",
        "float",
        "str-token",
        "empty",
        "np-negative",
        "np-2d",
        "bytes",
        "str",
        "int",
    ],
)
def test_bad_tokens_raise_hashing_error(name: str, block: Any, match: str) -> None:
    h = get_hasher(name)
    with pytest.raises(HashingError, match=match):
        h.chain([[1, 2], block])
    with pytest.raises(HashingError, match=match):
        h.extend(h.root(), block)


@pytest.mark.parametrize("name", BUILTIN)
def test_bad_scope_raises_hashing_error(name: str) -> None:
    h = get_hasher(name)
    with pytest.raises(HashingError, match="not both"):
        h.chain([[1]], cache_salt="a", salt_id=1)
    with pytest.raises(HashingError):
        h.root(cache_salt=5)  # type: ignore[arg-type]
    if name.startswith("vllm"):
        with pytest.raises(HashingError, match="lora_name"):
            h.root(lora_id=3)
        with pytest.raises(HashingError, match="lora_path"):
            h.root(lora_name="x")
        with pytest.raises(HashingError, match="salt_id"):
            h.root(salt_id=3)
        return
    for bad in (-1, 2**64, True, "3"):
        with pytest.raises(HashingError, match="lora_id"):
            h.root(lora_id=bad)  # type: ignore[arg-type]
        with pytest.raises(HashingError, match="salt_id"):
            h.root(salt_id=bad)  # type: ignore[arg-type]
    with pytest.raises(HashingError, match="lora_id"):
        h.root(lora_name="x")
    assert h.root(lora_id=2**64 - 1, salt_id=0).depth == 0


@pytest.mark.parametrize("name", BUILTIN)
def test_bad_multimodal_keys_and_states(name: str) -> None:
    h = get_hasher(name)
    st = h.root()
    if name.startswith("vllm"):  # vLLM offsets are relative to the block: an earlier item's < 0
        h.extend(st, [1], mm_keys=[(content_digest(b"x"), -1)])
        with pytest.raises(HashingError, match="start_offset"):
            h.extend(st, [1], mm_keys=[(content_digest(b"x"), -(2**63) - 1)])
    else:
        with pytest.raises(HashingError, match="start_offset"):
            h.extend(st, [1], mm_keys=[(content_digest(b"x"), -1)])
    with pytest.raises(HashingError, match="start_offset"):
        h.extend(st, [1], mm_keys=[(content_digest(b"x"), True)])
    with pytest.raises(HashingError):
        h.extend(st, [1], mm_keys=[content_digest(b"x")])
    with pytest.raises(HashingError):
        h.extend(st, [1], mm_keys=[(5, 0)])
    if not name.startswith("vllm"):
        with pytest.raises(HashingError, match="32 bytes"):
            h.extend(st, [1], mm_keys=[(b"short", 0)])
        with pytest.raises(HashingError, match="hex"):
            h.extend(st, [1], mm_keys=[("abc123", 0)])
    with pytest.raises(HashingError, match="one entry per block"):
        h.chain([[1], [2]], mm_keys=[[]])
    other = get_hasher("blake3" if name != "blake3" else "v2_sha256")
    with pytest.raises(HashingError, match="chain state"):
        h.extend(other.root(), [1])
    with pytest.raises(HashingError, match="chain state"):
        h.extend((name, b"", 0, ()), [1])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["v2_sha256", "v2_sha256_64", "vllm_sha256_cbor"])
def test_extra_ids_rejected_where_undefined(name: str) -> None:
    h = get_hasher(name)
    with pytest.raises(HashingError, match="extra ids"):
        h.extend(h.root(), [1, 2], token_extra_ids=[0, 0])
    with pytest.raises(HashingError, match="extra ids"):
        h.chain([[1, 2]], token_extra_ids=[[0, 0]])


@pytest.mark.parametrize("name", ["v1_block_key", "blake3"])
def test_extra_ids_checked(name: str) -> None:
    h = get_hasher(name)
    with pytest.raises(HashingError, match="2 entries for 3 tokens"):
        h.extend(h.root(), [1, 2, 3], token_extra_ids=[0, 0])
    with pytest.raises(HashingError, match="extra ids must be ints"):
        h.extend(h.root(), [1], token_extra_ids=[-1])
    with pytest.raises(HashingError, match="one entry per block"):
        h.chain([[1], [2]], token_extra_ids=[[0]])
    with_extra = h.chain_bytes([[1, 2]], token_extra_ids=[TokenIds([0, 0])])
    assert with_extra != h.chain_bytes([[1, 2]])  # extra ids (even zeros) are hashed


@pytest.mark.parametrize("name", ["v1_block_key", "vllm_sha256_cbor", "vllm_sha256_cbor_64"])
def test_digest_tokens_rejected_where_undefined(name: str) -> None:
    h = get_hasher(name)
    with pytest.raises(HashingError, match="digest token"):
        h.chain([[DIGEST, 1, 2]])


@pytest.mark.parametrize("name", ["v2_sha256", "blake3"])
def test_digest_tokens_must_be_32_bytes(name: str) -> None:
    with pytest.raises(HashingError, match="must be 32 bytes"):
        get_hasher(name).chain([[b"\x00" * 31, 1]])


# ------------------------------------------------------------------------ split_blocks


def test_split_blocks() -> None:
    toks = list(range(1, 11))
    assert split_blocks(toks, 4) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert split_blocks(toks, 4, include_partial=True) == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert split_blocks(toks, 4, drop_last_token=True, include_partial=True)[-1] == [9]
    assert split_blocks(toks[:9], 4, drop_last_token=True, include_partial=True) == [
        [1, 2, 3, 4],
        [5, 6, 7, 8],
    ]
    assert split_blocks([], 4, drop_last_token=True, include_partial=True) == []
    assert split_blocks([5], 4, drop_last_token=True, include_partial=True) == []
    out = split_blocks(TokenIds(toks), 5)
    assert all(type(b) is TokenIds for b in out)
    assert out == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    for bad in (0, -4, 2.0, True):
        with pytest.raises(HashingError, match="tokens_per_block"):
            split_blocks(toks, bad)  # type: ignore[arg-type]
    with pytest.raises(HashingError, match="token ids must be in"):
        split_blocks([1, -1], 4)

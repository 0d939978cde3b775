"""HashScope: one value for a request's hash scope, equal to the keyword and positional forms."""

from __future__ import annotations

from typing import Any

import pytest

from kvstream.errors import HashingError
from kvstream.hashing import HashScope, available_hashers, get_hasher
from kvstream.hashing.scope import EMPTY_SCOPE

BLOCKS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]


def scope_fields(name: str) -> dict[str, Any]:
    """A salted LoRA request's scope in the form algorithm ``name`` hashes."""
    if name.startswith(("vllm", "dynamo")):
        return {"lora_name": "ad", "lora_path": "/p/ad", "cache_salt": "tenant"}
    if name.startswith("sglang"):
        return {"lora_id": "0f" * 16, "cache_salt": "tenant", "extra_key": "x"}
    return {"lora_id": 7, "cache_salt": "tenant"}


@pytest.mark.parametrize("name", available_hashers())
def test_scope_value_equals_keywords(name: str) -> None:
    h = get_hasher(name)
    fields = scope_fields(name)
    scope = HashScope(**fields)
    want = h.chain_bytes(BLOCKS, **fields)
    assert h.chain_bytes(BLOCKS, scope) == want
    assert h.chain_bytes(BLOCKS, scope=scope) == want
    assert h.chain(BLOCKS, scope) == h.chain(BLOCKS, **fields)
    assert h.root(scope) == h.root(**fields) == h.root(scope=scope)
    # the scope changes the chain (the test would pass trivially otherwise)
    assert want != h.chain_bytes(BLOCKS)
    assert h.chain_bytes(BLOCKS, HashScope()) == h.chain_bytes(BLOCKS)


@pytest.mark.parametrize("name", ["v1_block_key", "v2_sha256", "blake3"])
def test_positional_form_still_works(name: str) -> None:
    h = get_hasher(name)
    assert h.chain_bytes(BLOCKS, 7, "tenant") == h.chain_bytes(
        BLOCKS, HashScope(lora_id=7, cache_salt="tenant")
    )
    assert h.root(None, None, 5) == h.root(HashScope(salt_id=5))


def test_of_builds_one_value() -> None:
    assert HashScope.of(None, (), {}) is EMPTY_SCOPE
    assert HashScope.of(None, (None, None), {"lora_name": None}) is EMPTY_SCOPE
    assert HashScope.of(None, (3, "s"), {"lora_name": "n"}) == HashScope(
        lora_id=3, cache_salt="s", lora_name="n"
    )
    s = HashScope(cache_salt="t")
    assert HashScope.of(None, (s,), {}) is s
    assert s.given() == {"cache_salt": "t"}
    with pytest.raises(AttributeError):
        s.cache_salt = "u"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((HashScope(),), {"cache_salt": "t"}),  # a scope and fields
        ((), {"scope": HashScope(), "lora_id": 1}),
        ((1, 2, 3, 4, 5), {}),  # more positional fields than the historical four
        ((1,), {"lora_id": 2}),  # a field twice
        ((), {"lora_idd": 1}),  # not a field
        ((), {"scope": {"cache_salt": "t"}}),  # not a HashScope
    ],
)
def test_call_shape_errors_are_type_errors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    with pytest.raises(TypeError):
        get_hasher("v2_sha256").chain_bytes(BLOCKS, *args, **kwargs)


def test_algorithm_refusals_are_unchanged() -> None:
    # an extra_key only SGLang hashes: TypeError elsewhere, as the keyword was refused before
    with pytest.raises(TypeError, match="extra_key"):
        get_hasher("vllm_sha256_cbor").root(HashScope(extra_key="x"))
    with pytest.raises(TypeError, match="prompt_embeds"):
        get_hasher("v2_sha256").chain_bytes(BLOCKS, prompt_embeds=[None] * 3)
    with pytest.raises(HashingError, match="salt_id"):
        get_hasher("vllm_sha256_cbor").chain_bytes(BLOCKS, HashScope(salt_id=3))
    with pytest.raises(HashingError, match="lora_id"):
        get_hasher("v2_sha256").root(HashScope(lora_name="ad"))

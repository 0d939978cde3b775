"""``POST /query``'s fast path: token ids read from the JSON text into u32 bytes
(:func:`kvstream.hashing.accel.json_ids`, C when built) and hashed to Dynamo keys in one call.

The reference is the decoded path: ``IndexService.query(decode(body, QueryRequest))`` (a
Python int per id, msgspec's validation). ``query_body`` must give the same answer or the same
error for every body, fast or not; ``json_ids`` in C must equal its pure-Python twin.
"""

from __future__ import annotations

import asyncio
import json
import random
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serve_support import Engine, eventually, expected_answer

from kvstream.hashing import accel
from kvstream.serve import Client, IndexService, ServeConfig
from kvstream.serve.requests import QueryRequest, decode, read_query_tokens

BS = 4
native_only = pytest.mark.skipif(
    accel._json_ids_c is None,
    reason="the C extension is not built or KVSTREAM_NO_NATIVE is set",
)

_WS = st.sampled_from(["", " ", "  ", "\n", "\t", "\r\n "])


@st.composite
def json_arrays(draw: st.DrawFn) -> bytes:
    """Token arrays as clients write them, with random whitespace, sometimes spoilt (a
    sign, a fraction, an exponent, a leading zero, a stray comma, a value over u32)."""
    ids = draw(st.lists(st.integers(0, 2**33), max_size=30))
    parts = [str(i) for i in ids]
    if parts and draw(st.booleans()):
        at = draw(st.integers(0, len(parts) - 1))
        spoil = draw(st.sampled_from(["-", "0", ".0", "e1", "E+0", " x", '"', ",", "[", "]"]))
        parts[at] = spoil + parts[at] if spoil in ("-", "0", '"', "[") else parts[at] + spoil
    text = draw(_WS) + "[" + draw(_WS)
    for i, p in enumerate(parts):
        if i:
            text += draw(_WS) + "," + draw(_WS)
        text += p
    text += draw(_WS) + "]" + draw(_WS)
    return text.encode()


@native_only
@settings(max_examples=400, deadline=None)
@given(json_arrays())
def test_json_ids_equal_the_python_twin(text: bytes) -> None:
    got = accel.json_ids(text)
    assert got == accel.py_json_ids(text)
    if got is not None:  # only valid JSON arrays of u32 ints are read
        values = json.loads(text)
        assert all(type(v) is int and 0 <= v < 2**32 for v in values)
        assert got == struct.pack(f"<{len(values)}I", *values)


@native_only
@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=40))
def test_json_ids_of_any_bytes_equal_the_python_twin(text: bytes) -> None:
    assert accel.json_ids(text) == accel.py_json_ids(text)


@pytest.fixture
async def service() -> AsyncIterator[IndexService]:
    async with IndexService(ServeConfig(port=0, block_size=BS, max_tokens=200)) as svc:
        yield svc


def _outcome(f: Any, *args: Any) -> Any:
    try:
        return ("ok", f(*args))
    except Exception as exc:  # compared, not swallowed
        return ("err", type(exc).__name__, str(exc))


def _bodies(rng: random.Random, prompts: list[list[int]]) -> list[bytes]:
    p = prompts[0]
    out = [
        json.dumps({"token_ids": q, "model_name": "m"}).encode() for q in prompts
    ]  # the client's own form
    out += [
        json.dumps({"model_name": "m", "token_ids": p}, separators=(",", ":")).encode(),
        json.dumps({"token_ids": p, "model_name": "m"}, indent=2).encode(),
        json.dumps({"token_ids": p, "model_name": "m", "lora_name": "adapter"}).encode(),
        json.dumps({"token_ids": p, "model_name": "m", "lora_name": ""}).encode(),
        json.dumps({"token_ids": p, "model_name": "m", "unknown_field": [1, 2]}).encode(),
        json.dumps({"token_ids": p, "model_name": "m", "cache_salt": "s"}).encode(),
        json.dumps({"token_ids": p, "model_name": "m", "hash_algo": "vllm_sha256_64"}).encode(),
        json.dumps({"token_ids": [], "model_name": "m"}).encode(),
        json.dumps({"token_ids": p[:3], "model_name": "m"}).encode(),
        json.dumps({"token_ids": [*p, -1], "model_name": "m"}).encode(),
        json.dumps({"token_ids": [*p, 2**32], "model_name": "m"}).encode(),
        json.dumps({"token_ids": [1.0, 2], "model_name": "m"}).encode(),
        json.dumps({"token_ids": ["1"], "model_name": "m"}).encode(),
        json.dumps({"token_ids": "1 2 3", "model_name": "m"}).encode(),
        json.dumps({"token_ids": [-1], "model_name": 5}).encode(),
        json.dumps({"token_ids": p, "model_name": 5}).encode(),
        json.dumps({"token_ids": p, "model_name": "nope"}).encode(),
        json.dumps({"token_ids": p}).encode(),
        json.dumps({"model_name": "m"}).encode(),
        json.dumps({"token_ids": list(range(201)), "model_name": "m"}).encode(),
        json.dumps([p]).encode(),
        b'{"token_ids": [1, 02], "model_name": "m"}',
        b'{"token_ids": [1, 2,], "model_name": "m"}',
        b'{"token_ids": [1e2], "model_name": "m"}',
        b'{"token_ids": [-0], "model_name": "m"}',
        b'{"token_ids": [1, 2], "model_name": "m"',
        # the first "token_ids": [ in the text is not the top-level key, or not only once
        b'{"x": {"token_ids": [1, 2, 3, 4, 5]}, "token_ids": [], "model_name": "m"}',
        b'{"x": {"token_ids": [1, 2]}, "token_ids": %s, "model_name": "m"}' % str(p).encode(),
        b'{"model_name": "m", "lora_name": "\\"token_ids\\": [1]", "token_ids": [1, 2, 3]}',
        b'{"token_ids": [1, 2, 3, 4], "token_ids": %s, "model_name": "m"}' % str(p).encode(),
        b'{"token_ids": %s, "model_name": "m", "token_ids": [1, 2, 3, 4]}' % str(p).encode(),
        b'{"token_ids": %s, "model_name": "m", "lora_name": "\\u0000"}' % str(p).encode(),
        b'{"token_ids": %s, "model_name": "m", "x": "\\u0000"}' % str(p).encode(),
        b'{"token\\u005fids": %s, "model_name": "m"}' % str(p).encode(),
        b'{"x": {"token_ids": %s}, "token_ids": "\\u0000", "model_name": "m"}' % str(p).encode(),
        b'{"token_ids": [1, 2]]], "model_name": "m"}',
        b'{"token_ids": [1, 2, "model_name": "m"}',
        b'{"token_ids": [1, 2',
        b'["token_ids": [1, 2]]',
        b"",
        b"not json",
    ]
    rng.shuffle(out)
    return out


async def test_query_body_answers_as_the_decoded_path(service: IndexService) -> None:
    rng = random.Random(9)
    engine = Engine(BS)
    try:
        c = Client(service.url)
        # with its replay socket: stores published before the subscription joins are replayed
        await asyncio.to_thread(
            c.register,
            1,
            engine.endpoint,
            model_name="m",
            block_size=BS,
            replay_endpoint=engine.replay_endpoint,
        )
        system = [rng.randrange(150_000) for _ in range(BS * 5)]
        prompts = [system + [rng.randrange(150_000) for _ in range(BS * 4)] for _ in range(8)]
        for p in prompts[:5]:
            engine.store(p)
        fleet = {(1, 0): engine}
        await eventually(
            lambda: all(
                c.query(p, model_name="m") == expected_answer(fleet, p, BS) for p in prompts
            )
        )
        c.close()
        answered = 0
        for body in _bodies(rng, prompts):
            got = _outcome(service.query_body, body)
            want = _outcome(lambda b: service.query(decode(b, QueryRequest)), body)
            assert got == want, body
            answered += got[0] == "ok"
        assert answered >= 10
        for p in prompts:
            body = json.dumps({"token_ids": p, "model_name": "m"}).encode()
            fast = read_query_tokens(body)  # the fast path takes the client's bodies
            assert fast is not None
            assert fast[1] == struct.pack(f"<{len(p)}I", *p)
            assert service.query_body(body) == expected_answer(fleet, p, BS)
    finally:
        engine.close()


_keys = st.sampled_from(["token_ids", "model_name", "lora_name", "x", "token_idsx"])
_scalars = st.one_of(
    st.integers(-2, 2**33),
    st.text(alphabet='ab"\\\x00[]: ', max_size=6),
    st.sampled_from(['"token_ids": [1]', "\x00", None, True, 1.5]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_keys, inner, max_size=3)),
    max_leaves=8,
)


@st.composite
def query_like_bodies(draw: st.DrawFn) -> bytes:
    """JSON objects around a ``token_ids`` key: nested copies of it, duplicates, strings
    that spell it, the reader's marker, as text with random spacing (or cut short)."""
    pairs = draw(st.lists(st.tuples(_keys, _values), max_size=4))
    if draw(st.booleans()):
        ids = draw(st.lists(st.integers(0, 2**32 - 1), max_size=8))
        pairs.insert(draw(st.integers(0, len(pairs))), ("token_ids", ids))
    sep = draw(st.sampled_from([(", ", ": "), (",", ":"), (" ,\n", " :  ")]))
    text = "{" + sep[0].join(json.dumps(k) + sep[1] + json.dumps(v) for k, v in pairs) + "}"
    if draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]
    return text.encode()


@settings(max_examples=500, deadline=None)
@given(query_like_bodies())
def test_read_query_tokens_reads_only_what_json_says(body: bytes) -> None:
    """Whenever the fast reader answers, the body is a JSON object whose top-level
    ``token_ids`` (its last one, as msgspec keeps it) is that u32 array."""
    got = read_query_tokens(body)
    if got is None:
        return
    req, raw = got
    obj = json.loads(body, object_pairs_hook=dict)
    ids = obj["token_ids"]
    assert raw == struct.pack(f"<{len(ids)}I", *ids)
    assert req.model_name == obj.get("model_name", "default")
    assert req.lora_name == obj.get("lora_name")

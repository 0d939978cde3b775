"""The API's request bodies: typed, validated in one msgspec decode.

Field names and types follow Dynamo's standalone indexer (1.6.1) so its clients work
unchanged: token ids are u32, ``/query_by_hash`` hashes are Dynamo's local hashes as signed
i64, ``instance_id`` is a u64. ``model_name`` defaults to ``default`` (Dynamo 1.6.1 requires
it; its documentation's examples omit it). kvstream's additions are optional fields:
``hash_algo`` (hashes, or tokens, in an engine's own algorithm), ``engine`` and
``hash_algo`` on ``/register``.

A body that is not JSON raises :class:`~kvstream.serve.errors.BadRequestError` (400); JSON
of the wrong shape :class:`~kvstream.serve.errors.InvalidRequestError` (422, Dynamo's status).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, TypeVar

import msgspec

from kvstream.hashing.accel import json_ids
from kvstream.serve.config import DEFAULT_MODEL
from kvstream.serve.errors import BadRequestError, InvalidRequestError

__all__ = [
    "PeerRequest",
    "QueryByHashRequest",
    "QueryRequest",
    "QueryTokensRequest",
    "RegisterRequest",
    "UnregisterRequest",
    "decode",
    "read_query_tokens",
]

U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
#: a u64 (msgspec takes no bound above int64: the upper one is checked by the service)
U64 = Annotated[int, msgspec.Meta(ge=0)]
I64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class QueryRequest(msgspec.Struct, forbid_unknown_fields=False):
    """``POST /query`` and ``POST /route``."""

    token_ids: list[U32]
    model_name: str = DEFAULT_MODEL
    lora_name: str | None = None
    routing_group: str | None = None
    #: kvstream: hash the tokens with this engine algorithm and match the engine's hashes
    hash_algo: str | None = None
    cache_salt: str | None = None


class QueryTokensRequest(msgspec.Struct, forbid_unknown_fields=False):
    """``POST /query`` read for the fast path: :class:`QueryRequest`'s fields with
    ``token_ids`` kept as its JSON text (the service reads plain u32 arrays from it in C,
    :func:`kvstream.hashing.accel.json_ids`; anything else is decoded as a QueryRequest)."""

    token_ids: msgspec.Raw
    model_name: str = DEFAULT_MODEL
    lora_name: str | None = None
    routing_group: str | None = None
    hash_algo: str | None = None
    cache_salt: str | None = None


class QueryByHashRequest(msgspec.Struct, forbid_unknown_fields=False):
    """``POST /query_by_hash``: Dynamo local hashes (signed i64), or, with ``hash_algo``,
    the engine's own block hashes (u64 ints, or hex strings for 256-bit algorithms)."""

    block_hashes: list[Any]
    model_name: str = DEFAULT_MODEL
    lora_name: str | None = None
    routing_group: str | None = None
    hash_algo: str | None = None


class RegisterRequest(msgspec.Struct, forbid_unknown_fields=False):
    """``POST /register``: one engine rank's ZMQ publisher."""

    instance_id: U64
    endpoint: str
    model_name: str = DEFAULT_MODEL
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    dp_rank: U32 = 0
    replay_endpoint: str | None = None
    routing_group: str | None = None
    #: kvstream: the wire dialect (vllm or sglang) and the engine's block hash algorithm
    engine: str | None = None
    hash_algo: str | None = None


class UnregisterRequest(msgspec.Struct, forbid_unknown_fields=False):
    """``POST /unregister``: every rank of an instance, or one rank."""

    instance_id: U64
    model_name: str = DEFAULT_MODEL
    dp_rank: U32 | None = None
    routing_group: str | None = None


class PeerRequest(msgspec.Struct, forbid_unknown_fields=False):
    """``POST /register_peer`` and ``/deregister_peer``."""

    url: str


_T = TypeVar("_T")
_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def decode(body: bytes, kind: type[_T]) -> _T:
    """``body`` as a ``kind`` (see the module docstring for the errors)."""
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        return dec.decode(body)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequestError(f"the request body is not JSON: {exc}") from None
    except UnicodeDecodeError as exc:  # msgspec's error for a string that is not UTF-8
        raise BadRequestError(f"the request body is not UTF-8 JSON: {exc}") from None


_query_tokens: Final = msgspec.json.Decoder(QueryTokensRequest)


#: the ``token_ids`` key and the opening bracket of its array
_IDS_KEY: Final = re.compile(rb'"token_ids"[ \t\r\n]*:[ \t\r\n]*\[')
#: JSON that stands in for the ids while the rest of the body is decoded (the string "\0")
_MARK: Final = b'"\\u0000"'


def read_query_tokens(body: bytes) -> tuple[QueryTokensRequest, bytes] | None:
    """``POST /query``'s body as a :class:`QueryTokensRequest` and its token ids as u32 LE
    bytes, reading the ids array once (:func:`~kvstream.hashing.accel.json_ids`, C when
    built) and the rest of the body with msgspec; None when the body is anything else than
    a JSON object whose top-level ``token_ids`` is a plain array of u32 (the caller then
    decodes it as a :class:`QueryRequest`, which answers or reports the error).

    The first ``"token_ids": [`` in the text is taken for the ids, its array replaced by a
    marker and the rest decoded: the answer stands only when the decoded ``token_ids`` is
    that marker (so it was the top-level key, once) and the body held no marker of its own.
    """
    m = _IDS_KEY.search(body)
    if m is None:
        return None
    start = m.end() - 1
    end = body.find(b"]", start) + 1
    if not end:
        return None
    ids = json_ids(memoryview(body)[start:end])
    if ids is None:
        return None
    rest = b"%s%s%s" % (body[:start], _MARK, body[end:])
    if rest.count(_MARK) != 1:  # the ids are digits: a marker of the body's own is in rest
        return None
    try:
        req = _query_tokens.decode(rest)
    except (msgspec.MsgspecError, UnicodeDecodeError):
        return None  # the decoded path says what is wrong
    if bytes(req.token_ids) != _MARK:
        return None
    return req, ids

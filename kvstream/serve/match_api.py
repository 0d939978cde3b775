"""``POST /match`` (kvstream): a model's per-worker prefix matches, as
:meth:`kvstream.index.PrefixIndex.match` returns them.

It is what a router that fans a request out over several services needs
(:class:`kvstream.index.shards.ShardedIndex` over :class:`kvstream.serve.shards.RemoteShard`):
every candidate's matched and tier-weighted blocks, whether the index trusts it and why not,
in candidate order, in any key mode (``dynamo``, ``engine``, ``tokens``). The router scores
the merged matches itself, so a sharded decision equals an unsharded one.

Request (JSON)::

    {"token_ids": [u32, ...],                 # or "tokens": base64 of u32 little-endian
     "model_name": "default",                 #  ids (one of the two; [] with "workers": []
                                              #  asks only for the worker list)
     "routing_group": null,
     "workers": [["instance", rank or null], ...] or null (every worker of the model),
     "layer_group_id": 0, "tier_weights": [1.0, ...] or null (the index's defaults),
     "hash_algo": null, "tokens_per_block": null,   # what the caller expects workers to use
     "request": {"lora_id", "lora_name", "cache_salt", "salt_id", "drop_last_token",
                 "mm_keys": per block null or [["mm", hex digest, offset, uuid] |
                                               ["b", hex bytes, offset] |
                                               ["s", identifier, offset], ...]} or null}

Answer (200)::

    {"num_tokens": n,
     "matches": [{"instance_id", "dp_rank", "matched_blocks", "weighted_blocks",
                  "request_blocks", "tokens_per_block", "hash_algo", "trusted", "note"}, ...],
     "workers": [["instance", rank or null], ...]}    # the model's workers, every answer

Errors: a candidate advertising another ``hash_algo``/``tokens_per_block`` than the request
names: 409 (ConflictError, the index's HashConfigMismatchError message); a request the index
cannot hash (an unknown algorithm, a ``salt_id`` in a token-keyed index): 422; an unknown
model: 404; more token ids than ``max_tokens``: 413.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Final

import msgspec

from kvstream._types import TokenIds
from kvstream.errors import ConfigError, HashingError
from kvstream.index.errors import HashConfigMismatchError
from kvstream.index.matching import HashRequest, MatchResult, WorkerMatch, new_worker_match
from kvstream.index.types import WorkerKey
from kvstream.serve.config import DEFAULT_MODEL
from kvstream.serve.errors import ConflictError, InvalidRequestError, PayloadTooLargeError
from kvstream.serve.requests import decode

if TYPE_CHECKING:
    from kvstream.serve.service import IndexService

__all__ = [
    "MatchAnswer",
    "MatchRequest",
    "MatchRow",
    "WireHashRequest",
    "match_handler",
    "request_from_wire",
    "request_to_wire",
    "result_from_wire",
]

U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
_JSON: Final = b"content-type: application/json\r\n"
_encode = msgspec.json.Encoder().encode

#: a worker on the wire: [instance id, DP rank or null]
WireWorker = tuple[str, int | None]


class WireHashRequest(msgspec.Struct, forbid_unknown_fields=False):
    """A :class:`~kvstream.index.matching.HashRequest` (``mm_keys`` as in the module doc)."""

    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    salt_id: int | None = None
    drop_last_token: bool = True
    mm_keys: list[list[list[Any]] | None] | None = None


class MatchRequest(msgspec.Struct, forbid_unknown_fields=False):
    """``POST /match`` (module docstring): ``token_ids``, or ``tokens`` (base64 in JSON;
    what :class:`~kvstream.serve.shards.RemoteShard` sends: a tenth of the decoding)."""

    token_ids: list[U32] | None = None
    tokens: bytes | None = None
    model_name: str = DEFAULT_MODEL
    routing_group: str | None = None
    workers: list[WireWorker] | None = None
    layer_group_id: int = 0
    #: weights of the cache levels (GPU first; deeper levels take the last one)
    tier_weights: Annotated[list[float], msgspec.Meta(min_length=1, max_length=16)] | None = None
    hash_algo: str | None = None
    tokens_per_block: int | None = None
    request: WireHashRequest | None = None


class MatchRow(msgspec.Struct):
    """One candidate's :class:`~kvstream.index.matching.WorkerMatch`."""

    instance_id: str
    dp_rank: int | None
    matched_blocks: int
    weighted_blocks: float
    request_blocks: int
    tokens_per_block: int | None
    hash_algo: str | None
    trusted: bool
    note: str = ""


class MatchAnswer(msgspec.Struct):
    """``POST /match``'s answer."""

    num_tokens: int
    matches: list[MatchRow]
    workers: list[WireWorker]


# ---------------------------------------------------------------------- conversions


def _mm_to_wire(mm_keys: Sequence[Any] | None) -> list[list[list[Any]] | None] | None:
    if mm_keys is None:
        return None
    out: list[list[list[Any]] | None] = []
    for entry in mm_keys:
        if entry is None:
            out.append(None)
            continue
        keys: list[list[Any]] = []
        for key in entry:
            if hasattr(key, "hash") and hasattr(key, "start_offset"):
                keys.append(["mm", bytes(key.hash).hex(), key.start_offset, key.uuid])
            elif isinstance(key, (tuple, list)) and len(key) == 2:
                ident, off = key
                if isinstance(ident, (bytes, bytearray)):
                    keys.append(["b", bytes(ident).hex(), off])
                else:
                    keys.append(["s", ident, off])
            else:
                raise ConfigError(f"cannot send multimodal key {key!r} to a remote shard")
        out.append(keys)
    return out


def _mm_from_wire(data: list[list[list[Any]] | None] | None) -> tuple[Any, ...] | None:
    if data is None:
        return None
    from kvstream.events.model import MmKey

    out: list[tuple[Any, ...] | None] = []
    for entry in data:
        if entry is None:
            out.append(None)
            continue
        keys: list[Any] = []
        for item in entry:
            try:
                kind, ident, off, *rest = item
                if kind == "mm":
                    keys.append(MmKey(hash=bytes.fromhex(ident), start_offset=off, uuid=rest[0]))
                elif kind == "b":
                    keys.append((bytes.fromhex(ident), int(off)))
                elif kind == "s":
                    keys.append((str(ident), int(off)))
                else:
                    raise ValueError(f"unknown kind {kind!r}")
            except (ValueError, TypeError, IndexError) as exc:
                raise InvalidRequestError(f"request.mm_keys: bad key {item!r}: {exc}") from None
        out.append(tuple(keys))
    return tuple(out)


def request_to_wire(req: HashRequest | None) -> WireHashRequest | None:
    """``req`` as ``/match`` takes it; ConfigError for a multimodal key it cannot carry."""
    if req is None:
        return None
    return WireHashRequest(
        lora_id=req.lora_id,
        lora_name=req.lora_name,
        cache_salt=req.cache_salt,
        salt_id=req.salt_id,
        drop_last_token=req.drop_last_token,
        mm_keys=_mm_to_wire(req.mm_keys),
    )


def request_from_wire(w: WireHashRequest | None) -> HashRequest | None:
    """The :class:`HashRequest` a ``/match`` body carries (InvalidRequestError for a bad
    multimodal key)."""
    if w is None:
        return None
    return HashRequest(
        lora_id=w.lora_id,
        lora_name=w.lora_name,
        cache_salt=w.cache_salt,
        salt_id=w.salt_id,
        drop_last_token=w.drop_last_token,
        mm_keys=_mm_from_wire(w.mm_keys),
    )


def _row(m: WorkerMatch) -> MatchRow:
    w = m.worker
    return MatchRow(
        w.instance_id,
        w.dp_rank,
        m.matched_blocks,
        m.weighted_blocks,
        m.request_blocks,
        m.tokens_per_block,
        m.hash_algo,
        m.trusted,
        m.note,
    )


def result_from_wire(answer: MatchAnswer) -> MatchResult:
    """The :class:`MatchResult` of a ``/match`` answer."""
    return MatchResult(
        tuple(
            new_worker_match(
                WorkerKey(r.instance_id, r.dp_rank),
                r.matched_blocks,
                float(r.weighted_blocks),
                r.request_blocks,
                r.tokens_per_block,
                r.hash_algo,
                r.trusted,
                r.note,
            )
            for r in answer.matches
        ),
        answer.num_tokens,
    )


# ---------------------------------------------------------------------- the handler


def answer_match(svc: IndexService, req: MatchRequest) -> MatchAnswer:
    """``POST /match``'s answer from ``svc``'s index of the request's model."""
    tokens: list[int] | TokenIds
    if (req.token_ids is None) == (req.tokens is None):
        raise InvalidRequestError("give one of token_ids and tokens")
    if req.tokens is not None:
        if len(req.tokens) % 4:
            raise InvalidRequestError("tokens must be base64 of u32 little-endian ids")
        tokens = TokenIds.from_bytes(req.tokens)
    else:
        assert req.token_ids is not None
        tokens = req.token_ids
    limit = svc.config.max_tokens
    if len(tokens) > limit:
        raise PayloadTooLargeError(
            f"{len(tokens)} token ids is over the limit of {limit} (--max-tokens)"
        )
    m = svc.model(req.model_name, req.routing_group)
    kwargs: dict[str, Any] = {}
    if req.tier_weights is not None:
        kwargs["tier_weights"] = tuple(req.tier_weights)
    try:
        res = m.index.match(
            tokens,
            layer_group_id=req.layer_group_id,
            workers=req.workers,
            request=request_from_wire(req.request),
            hash_algo=req.hash_algo,
            tokens_per_block=req.tokens_per_block,
            **kwargs,
        )
    except HashConfigMismatchError as exc:
        raise ConflictError(str(exc)) from None
    except (ConfigError, HashingError, ValueError) as exc:
        raise InvalidRequestError(str(exc)) from None
    return MatchAnswer(
        res.num_tokens,
        [_row(x) for x in res.matches],
        [(w.instance_id, w.dp_rank) for w in m.index.workers()],
    )


def match_handler(svc: IndexService) -> Callable[[bytes], tuple[int, bytes, bytes]]:
    """The route handler of ``POST /match`` for :mod:`kvstream.serve.http`: status, body
    and header lines."""

    def match(body: bytes) -> tuple[int, bytes, bytes]:
        return 200, _encode(answer_match(svc, decode(body, MatchRequest))), _JSON

    return match

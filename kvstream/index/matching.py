"""Request hashing for matching, and the per-worker match results.

A request is hashed once per hash domain (algorithm, block size) with the hasher the workers
advertise, never with one the caller picks: :class:`RequestHasher` builds hashers by the name
found in the events (plus algorithm-level parameters such as vLLM's seed, which events do not
carry) and caches the request's chain per domain.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvstream.errors import HashingError
from kvstream.hashing import BlockHasher, get_hasher, split_blocks
from kvstream.hashing.accel import pack_request
from kvstream.hashing.prefix_cache import DEFAULT_CHECKPOINT_TOKENS, PrefixCache
from kvstream.index.record import Record
from kvstream.index.types import WorkerKey

__all__ = [
    "HashRequest",
    "MatchResult",
    "RequestHasher",
    "WorkerMatch",
    "new_worker_match",
]


@dataclass(frozen=True, slots=True)
class HashRequest:
    """What enters a request's block hashes besides its tokens (see ``BlockHasher.root``).

    ``drop_last_token`` (default True) hashes ``tokens[:-1]``: the last prompt token is never
    reused (the engine needs its logits), so the match counts exactly the blocks an engine
    can skip. ``mm_keys``: per full block, its multimodal keys (None or empty for none).
    """

    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    salt_id: int | None = None
    drop_last_token: bool = True
    mm_keys: tuple[Any, ...] | None = None


class RequestHasher:
    """Hashers by algorithm name, with per-algorithm parameters (``{"vllm_sha256_cbor":
    {"seed": "..."}}``); unknown names raise UnknownHashAlgorithmError.

    Requests are packed once (u32 ids, in C for lists) and hashed by the algorithm's
    whole-request chain (in C for the SHA-256 and BLAKE3 algorithms when the extension is
    built, :mod:`kvstream.hashing.accel`).

    ``prefix_cache_bytes`` > 0 enables a bounded LRU of per-prefix chain hashes
    (:class:`~kvstream.hashing.prefix_cache.PrefixCache`, keyed by hasher and its parameters,
    block size, request scope and prefix tokens), so a recurring prefix, such as a system
    prompt or a conversation's previous turns, is hashed once. Its memory is bounded by
    ``prefix_cache_bytes`` (32 MiB, ``prefix_cache.DEFAULT_MAX_BYTES``, holds about 800 8k-token
    requests) plus a 65,536-fingerprint admission filter (~4 MiB); ``checkpoint_tokens``
    (default 512) sets its reuse granularity; only prefixes that recur are cached, and
    requests with multimodal keys bypass it. It is off by default: with the C chains,
    hashing costs about 0.2-0.3 us per block, and measured on a busy machine
    (``benchmarks/bench_hashing.py --request``) the cache pays off only when most of each
    request recurs (in a tight loop: from about half). Thread-safe.
    """

    def __init__(
        self,
        params: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        prefix_cache_bytes: int = 0,
        checkpoint_tokens: int = DEFAULT_CHECKPOINT_TOKENS,
    ) -> None:
        self._params = {k: dict(v) for k, v in (params or {}).items()}
        self._hashers: dict[str, BlockHasher] = {}
        self.prefix_cache = PrefixCache(prefix_cache_bytes, checkpoint_tokens)

    def hasher(self, hash_algo: str) -> BlockHasher:
        """The (cached) hasher for ``hash_algo``."""
        h = self._hashers.get(hash_algo)
        if h is None:
            h = self._hashers[hash_algo] = get_hasher(hash_algo, **self._params.get(hash_algo, {}))
        return h

    def hashes(
        self,
        tokens: Any,
        hash_algo: str,
        tokens_per_block: int,
        req: HashRequest | None = None,
    ) -> list[bytes]:
        """The published hashes of the request's full blocks (of ``tokens[:-1]`` when
        ``req.drop_last_token``), as a worker with this algorithm and block size has them.

        ``tokens``: any token container the hashers accept (lists are fastest). Bad ids or a
        ``tokens_per_block`` that is not a positive int raise HashingError.
        """
        req = req or _DEFAULT_REQUEST
        h = self.hasher(hash_algo)
        if req.mm_keys is not None and any(req.mm_keys):
            blocks = split_blocks(tokens, tokens_per_block, drop_last_token=req.drop_last_token)
            mm = list(req.mm_keys[: len(blocks)])
            mm += [None] * (len(blocks) - len(mm))
            return h.chain_bytes(
                blocks,
                req.lora_id,
                req.cache_salt,
                req.salt_id,
                lora_name=req.lora_name,
                mm_keys=mm,
            )
        if (
            isinstance(tokens_per_block, bool)
            or not isinstance(tokens_per_block, int)
            or tokens_per_block <= 0
        ):
            raise HashingError(f"tokens_per_block must be a positive int, got {tokens_per_block!r}")
        root = h.root(req.lora_id, req.cache_salt, req.salt_id, req.lora_name)
        fused = self.prefix_cache.chain_tokens(
            h, root, tokens, tokens_per_block, req.drop_last_token
        )
        if fused is not None:
            return fused
        raw = pack_request(tokens, req.drop_last_token)
        return self.prefix_cache.chain(h, root, raw, tokens_per_block)


_DEFAULT_REQUEST = HashRequest()


class WorkerMatch(Record):
    """How much of a request one worker holds, and whether the index trusts it.

    ``matched_blocks``: leading request blocks the worker holds with their whole chain;
    ``weighted_blocks``: the same, each block weighted by the best tier holding it;
    ``request_blocks``: full blocks of the request at this worker's block size;
    ``trusted``: False while the worker is stale (the router then counts no overlap);
    ``note``: why the worker could not be matched or is not trusted (empty otherwise).
    """

    __slots__ = ()
    worker: WorkerKey
    matched_blocks: int
    weighted_blocks: float
    request_blocks: int
    tokens_per_block: int | None
    hash_algo: str | None
    trusted: bool
    note: str = ""

    @property
    def matched_tokens(self) -> int:
        """``matched_blocks`` in tokens."""
        return self.matched_blocks * (self.tokens_per_block or 0)

    @property
    def usable_blocks(self) -> int:
        """``matched_blocks`` when trusted, else 0 (what a router may count on)."""
        return self.matched_blocks if self.trusted else 0

    @property
    def usable_weighted(self) -> float:
        """``weighted_blocks`` when trusted, else 0."""
        return self.weighted_blocks if self.trusted else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "worker": str(self.worker),
            "matched_blocks": self.matched_blocks,
            "matched_tokens": self.matched_tokens,
            "weighted_blocks": round(self.weighted_blocks, 6),
            "request_blocks": self.request_blocks,
            "tokens_per_block": self.tokens_per_block,
            "hash_algo": self.hash_algo,
            "trusted": self.trusted,
            "note": self.note,
        }


#: ``WorkerMatch`` itself (a record: its constructor is one C call with the native core)
new_worker_match: Final = WorkerMatch


class MatchResult(Record):
    """Per-worker matches of one request (candidate order), see :class:`WorkerMatch`."""

    __slots__ = ()
    matches: tuple[WorkerMatch, ...]
    num_tokens: int

    def __iter__(self) -> Iterator[WorkerMatch]:
        return iter(self.matches)

    def __len__(self) -> int:
        return len(self.matches)

    def get(self, worker: WorkerKey | tuple[str, int | None]) -> WorkerMatch | None:
        """The match of ``worker`` (None when it was not a candidate)."""
        for m in self.matches:
            if m.worker == worker:
                return m
        return None

    def best(self) -> WorkerMatch | None:
        """The trusted worker with the longest match (first in candidate order on ties)."""
        best: WorkerMatch | None = None
        for m in self.matches:
            if (
                m.trusted
                and m.matched_blocks
                and (best is None or m.matched_blocks > best.matched_blocks)
            ):
                best = m
        return best

    def as_list(self) -> list[dict[str, Any]]:
        """JSON-able form."""
        return [m.as_dict() for m in self.matches]


#: ``MatchResult`` itself (see :data:`new_worker_match`)
new_match_result: Final = MatchResult


def weights_tuple(weights: Sequence[float]) -> tuple[float, ...]:
    """Validate tier weights (non-empty, each in 0..1e6)."""
    out = tuple(float(w) for w in weights)
    if not out or any(not 0.0 <= w <= 1e6 for w in out):
        raise ValueError(
            f"tier weights must be a non-empty sequence of values >= 0, got {weights!r}"
        )
    return out

"""The state shared by the roles of :class:`~kvstream.cache.manager.KVCacheManager`
(admission, commit, KV I/O), with the lookups and the request hashing they all use."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeAlias

from kvstream._types import TokenIds
from kvstream.cache.block import Block
from kvstream.cache.block_pool import BlockPool
from kvstream.cache.config import CacheConfig
from kvstream.cache.errors import (
    CacheInvariantError,
    KVAccessError,
    RequestError,
    UnknownRequestError,
)
from kvstream.cache.request import (
    GroupMatch,
    GroupState,
    MmItem,
    RequestState,
    block_mm_keys,
    normalize_mm_items,
)
from kvstream.cache.storage import KVStorage
from kvstream.cache.tiering import Tiers
from kvstream.errors import HashingError
from kvstream.events.emitter import EventRecorder
from kvstream.events.model import MmKey
from kvstream.hashing import BlockHasher, ChainState, HashScope
from kvstream.hashing.blocks import coerce_tokens

if TYPE_CHECKING:
    import torch

__all__ = ["ManagerState", "TrustedChain"]

#: ``EventEmitter.stored_chain_trusted``: (group, parent hash, hashes, packed tokens).
TrustedChain: TypeAlias = Callable[[int, "bytes | None", list[bytes], TokenIds], None]


class ManagerState:
    """The state every role of :class:`~kvstream.cache.manager.KVCacheManager` works on
    (set by its constructor), and the lookups and request hashing they share."""

    config: CacheConfig
    device: torch.device | None
    _hasher: BlockHasher
    _tpb: int
    _recorder: EventRecorder
    #: The recorder's stored_chain_trusted when it is an EventEmitter of our hash width.
    _trusted_chain: TrustedChain | None
    _windows: list[int | None]
    _swa: list[int]
    _layers: list[tuple[int, int]]
    _storage: KVStorage | None
    _tiers: Tiers | None
    _pools: list[BlockPool]
    _requests: dict[str, RequestState]
    _added: int
    _rejected: int
    _prompt_tokens: int
    _reusable_tokens: int
    _hit_blocks: list[int]
    _queried_blocks: list[int]
    _plain_root: ChainState | None  # the root without LoRA or salt
    #: One full-attention group on the GPU alone: requests are admitted by _admit_plain.
    _plain: bool
    _plain_matches: dict[int, GroupMatch]  # _admit_plain's, by boundary

    def _get(self, request_id: str) -> RequestState:
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(request_id)
        return req

    def _gid(self, layer_group_id: int) -> int:
        if (
            isinstance(layer_group_id, bool)
            or not isinstance(layer_group_id, int)
            or not 0 <= layer_group_id < len(self._pools)
        ):
            raise KVAccessError(
                f"layer_group_id must be in 0..{len(self._pools) - 1}, got {layer_group_id!r}"
            )
        return layer_group_id

    def _need_storage(self) -> KVStorage:
        if self._storage is None:
            raise KVAccessError("this manager is metadata-only: it holds no K/V tensors")
        return self._storage

    def _check_range(self, req: RequestState, gid: int, lo: int, hi: int) -> None:
        for name, v in (("start", lo), ("end", hi)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise KVAccessError(f"{name} must be an int, got {v!r}")
        if not 0 <= lo <= hi <= req.num_tokens:
            raise KVAccessError(
                f"positions [{lo}, {hi}) are outside request {req.request_id!r}'s "
                f"{req.num_tokens} tokens"
            )
        released = req.groups[gid].released * self._tpb
        if lo < released and hi > lo:
            raise KVAccessError(
                f"positions before {released} of request {req.request_id!r} left layer group "
                f"{gid}'s sliding window and were released"
            )

    def _ids(self, gs: GroupState, lo: int, hi: int) -> list[int]:
        tpb = self._tpb
        out: list[int] = []
        for b in gs.blocks[lo // tpb : (hi - 1) // tpb + 1]:
            if b is None:  # excluded by _check_range
                raise CacheInvariantError("a held position has no block")
            out.append(b.block_id)
        return out

    @staticmethod
    def _held(table: list[Block | None], i: int, gid: int) -> Block:
        b = table[i]
        if b is None:
            raise CacheInvariantError(f"position {i} of group {gid} has no block to commit")
        return b

    def _check_prompt(
        self, prompt_tokens: Any, mm_items: Iterable[Any]
    ) -> tuple[bytes, tuple[MmItem, ...]]:
        try:
            raw = coerce_tokens(prompt_tokens, "prompt_tokens")
        except HashingError as exc:
            raise RequestError(str(exc)) from None
        if not raw:
            raise RequestError("a request needs at least one prompt token")
        return raw, normalize_mm_items(mm_items, len(raw) >> 2) if mm_items else ()

    def _root(
        self, lora_id: int | None, lora_name: str | None, cache_salt: str | None
    ) -> ChainState:
        if lora_id is None and lora_name is None and cache_salt is None:
            # every request without a scope starts here: computed once (a root is a pure
            # function of the hasher and the scope, and ChainState is immutable)
            root = self._plain_root
            if root is None:
                root = self._plain_root = self._hasher.root()
            return root
        return self._hasher.root(
            HashScope(lora_id=lora_id, cache_salt=cache_salt, lora_name=lora_name)
        )

    def _hash_blocks(
        self, chain: ChainState, raw: bytes, first_index: int, items: tuple[MmItem, ...]
    ) -> tuple[list[bytes], ChainState]:
        # Hash the full blocks of `raw` (whose first block is the request's block
        # `first_index`); returns their hashes and the new state.
        step = 4 * self._tpb
        n = len(raw) // step
        if not items:
            # the whole-request chain (in C for the BLAKE3/SHA-256 algorithms), equal to
            # folding extend() over the blocks; its last chain key resumes the state
            if not n:
                return [], chain
            hasher = self._hasher
            out, resume_at = hasher.chain_raw(chain, raw, self._tpb, every=n)
            return out, hasher.resume(chain, resume_at[-1], chain.depth + n)
        extend = self._hasher.extend
        hashes: list[bytes] = []
        for j in range(n):
            blk = TokenIds.from_bytes(raw[j * step : (j + 1) * step])
            keys = block_mm_keys(items, first_index + j, self._tpb)
            h, chain = extend(chain, blk, [(m.digest, off) for m, off in keys])
            hashes.append(h)
        return hashes, chain

    def _mm_keys(self, req: RequestState, index: int) -> tuple[MmKey, ...]:
        items = req.mm_items
        if not items:
            return ()
        return tuple(
            MmKey(hash=m.digest, start_offset=off, uuid=m.uuid)
            for m, off in block_mm_keys(items, index, self._tpb)
        )

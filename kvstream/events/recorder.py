"""What a paged KV-cache manager records into: the :class:`EventRecorder` interface (all the
cache depends on), and :class:`NullRecorder`, which records nothing, for events off. The
recorder that keeps events is :class:`~kvstream.events.emitter.EventEmitter`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol, runtime_checkable

from kvstream._types import PRIORITY_DEFAULT, TokenIds
from kvstream.events.deferred import DeferredBatch
from kvstream.events.model import AttentionKind, EventBatch, MmKey

__all__ = ["NULL_RECORDER", "EventRecorder", "NullRecorder"]


@runtime_checkable
class EventRecorder(Protocol):
    """What a cache manager records KV-cache events into (engine thread, synchronous).

    ``enabled`` is False for a recorder that discards everything (:class:`NullRecorder`), so
    callers may skip building arguments. Every hash is ``bytes``; ``cache_level`` 0 is the
    GPU, 1 host, 2 disk.
    """

    enabled: bool

    def created(
        self,
        layer_group_id: int,
        *,
        window_size: int,
        num_blocks_per_cache_level: Sequence[int],
        tokens_per_block: int,
        attention_kind: AttentionKind = AttentionKind.FULL,
    ) -> None:
        """Register (or re-announce, e.g. after a capacity change) a layer group."""
        ...

    def stored(
        self,
        layer_group_id: int,
        *,
        parent_hash: bytes | None,
        block_hash: bytes,
        token_ids: TokenIds | Sequence[int],
        cache_level: int = 0,
        priority: int = PRIORITY_DEFAULT,
        lora_id: int | None = None,
        lora_name: str | None = None,
        mm_keys: Sequence[MmKey] = (),
        cache_salt: str | None = None,
        token_extra_ids: TokenIds | Sequence[int] | None = None,
    ) -> None:
        """One block entered the cache; ``parent_hash`` is its parent (None at the root)."""
        ...

    def stored_chain(
        self,
        layer_group_id: int,
        *,
        parent_hash: bytes | None,
        block_hashes: Sequence[bytes],
        token_ids: TokenIds | Sequence[int],
        cache_level: int = 0,
        priority: int = PRIORITY_DEFAULT,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Consecutive full blocks entered the cache: block i's parent is block i-1, block 0's
        is ``parent_hash``; ``token_ids`` holds their tokens packed, ``tokens_per_block`` per
        block. The same as one ``stored`` call per block."""
        ...

    def removed(
        self, layer_group_id: int, block_hash: bytes, *, cache_level: int | None = None
    ) -> None:
        """A block left the cache (its last tier, ``cache_level`` when known)."""
        ...

    def removed_many(
        self, layer_group_id: int, block_hashes: Sequence[bytes], *, cache_level: int | None = None
    ) -> None:
        """Blocks left the cache, in this order; the same as one ``removed`` call per block."""
        ...

    def updated(
        self,
        layer_group_id: int,
        block_hash: bytes,
        *,
        cache_level: tuple[int, int] | None = None,
        priority: tuple[int, int] | None = None,
    ) -> None:
        """A block moved tier and/or changed priority; each change is (old, new)."""
        ...

    def cleared(self, layer_group_id: int | None = None) -> None:
        """Every block of the group (None: of every group) is gone."""
        ...

    def flush_iteration(self) -> None:
        """End of an engine iteration: materialise pending removals, reset coalescing."""
        ...

    def take(self) -> EventBatch | None:
        """Hand over every materialised event (None when there is none) and clear them."""
        ...

    def flush(self) -> EventBatch | None:
        """``flush_iteration()`` then ``take()``."""
        ...

    def take_deferred(self) -> DeferredBatch | None:
        """Like ``take`` but hands the raw records over (O(1)); the models are built by
        :meth:`DeferredBatch.materialize`, on whatever thread needs them."""
        ...

    def flush_deferred(self) -> DeferredBatch | None:
        """``flush_iteration()`` then ``take_deferred()``."""
        ...


class NullRecorder:
    """A recorder that records nothing: every method returns None and builds nothing.

    ``enabled`` is False so a cache manager may skip computing arguments altogether.
    """

    enabled: bool = False

    def created(
        self,
        layer_group_id: int,
        *,
        window_size: int,
        num_blocks_per_cache_level: Sequence[int],
        tokens_per_block: int,
        attention_kind: AttentionKind = AttentionKind.FULL,
    ) -> None:
        """Does nothing."""

    def stored(
        self,
        layer_group_id: int,
        *,
        parent_hash: bytes | None,
        block_hash: bytes,
        token_ids: TokenIds | Sequence[int],
        cache_level: int = 0,
        priority: int = PRIORITY_DEFAULT,
        lora_id: int | None = None,
        lora_name: str | None = None,
        mm_keys: Sequence[MmKey] = (),
        cache_salt: str | None = None,
        token_extra_ids: TokenIds | Sequence[int] | None = None,
    ) -> None:
        """Does nothing."""

    def stored_chain(
        self,
        layer_group_id: int,
        *,
        parent_hash: bytes | None,
        block_hashes: Sequence[bytes],
        token_ids: TokenIds | Sequence[int],
        cache_level: int = 0,
        priority: int = PRIORITY_DEFAULT,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Does nothing."""

    def removed(
        self, layer_group_id: int, block_hash: bytes, *, cache_level: int | None = None
    ) -> None:
        """Does nothing."""

    def removed_many(
        self, layer_group_id: int, block_hashes: Sequence[bytes], *, cache_level: int | None = None
    ) -> None:
        """Does nothing."""

    def updated(
        self,
        layer_group_id: int,
        block_hash: bytes,
        *,
        cache_level: tuple[int, int] | None = None,
        priority: tuple[int, int] | None = None,
    ) -> None:
        """Does nothing."""

    def cleared(self, layer_group_id: int | None = None) -> None:
        """Does nothing."""

    def flush_iteration(self) -> None:
        """Does nothing."""

    def take(self) -> None:
        """Always None."""

    def flush(self) -> None:
        """Always None."""

    def take_deferred(self) -> None:
        """Always None."""

    def flush_deferred(self) -> None:
        """Always None."""


#: A shared :class:`NullRecorder` (it has no state).
NULL_RECORDER: Final = NullRecorder()

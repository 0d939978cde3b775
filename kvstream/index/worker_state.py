"""Per-worker state of the prefix index: each worker's sequencing state and layer groups
(:class:`SourceState`, :class:`GroupState`, owned and mutated by
:class:`~kvstream.index.index.PrefixIndex` alone), and their read-only views
(:class:`WorkerInfo`, :class:`GroupInfo`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstream.index.domain import HashDomain
from kvstream.index.stats import SourceStats
from kvstream.index.table import GroupTable, native_table_type
from kvstream.index.token_table import TokenGroupTable, token_table_type
from kvstream.index.types import DomainKey, WorkerKey

__all__ = ["GroupInfo", "GroupState", "SourceState", "WorkerInfo"]

#: engine-keyed tables: the native type when built (chosen once, at import), else the twin
_ENGINE_TABLE: Callable[[int], GroupTable] = native_table_type() or GroupTable
_TOKEN_TABLE: Callable[[int, bool], TokenGroupTable] = token_table_type()


class GroupState:
    """One layer group of one worker: advertised metadata and its block table."""

    __slots__ = (
        "attention_kind",
        "capacity",
        "domain",
        "gid",
        "hash_algo",
        "limit",
        "max_block_tokens",
        "table",
        "tokens_per_block",
        "window_size",
    )

    def __init__(self, gid: int, bit: int, tokens: bool = False, dynamo: bool = False) -> None:
        self.gid = gid
        self.hash_algo: str | None = None
        self.tokens_per_block: int | None = None
        self.window_size: int | None = None
        self.attention_kind: str | None = None
        self.capacity: tuple[int, ...] = ()
        #: blocks the group can hold (all tiers); more cached blocks mean missed removals
        self.limit = 1 << 62
        self.max_block_tokens = 0
        self.table = _TOKEN_TABLE(bit, dynamo) if tokens else _ENGINE_TABLE(bit)
        self.domain: HashDomain | None = None


class SourceState:
    """Sequencing state and groups of one worker."""

    __slots__ = (
        "bit",
        "groups",
        "incarnation",
        "key",
        "next_id",
        "pending_clear",
        "slot",
        "stale",
        "stale_reason",
        "stats",
    )

    def __init__(self, key: WorkerKey, slot: int) -> None:
        self.key = key
        self.slot = slot
        self.bit = 1 << slot
        self.incarnation: int | None = None
        #: The id the next event must have; None: accept any (after an explicit resync).
        self.next_id: int | None = 0
        self.stale = False
        self.stale_reason = ""
        self.pending_clear: set[int] = set()
        self.groups: dict[int, GroupState] = {}
        self.stats = SourceStats()


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """What a worker advertised for one layer group, and its block counts."""

    layer_group_id: int
    hash_algo: str | None
    tokens_per_block: int | None
    window_size: int | None
    attention_kind: str | None
    num_blocks_per_cache_level: tuple[int, ...]
    max_block_tokens: int
    blocks: int
    ghost_blocks: int
    rooted_blocks: int
    domain: DomainKey | None


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A read-only view of one worker's state in the index."""

    worker: WorkerKey
    incarnation: int | None
    next_event_id: int | None
    stale: bool
    stale_reason: str
    groups: tuple[GroupInfo, ...]
    stats: SourceStats

    @property
    def trusted(self) -> bool:
        """True unless stale."""
        return not self.stale

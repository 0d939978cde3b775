"""The instrumented paged KV-cache manager (layer L3; the only place that imports torch).

::

    from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec

    cfg = CacheConfig(
        tokens_per_block=16,
        groups=[
            LayerGroupSpec(num_layers=4, num_kv_heads=8, head_dim=64, num_blocks=1024),
            LayerGroupSpec(num_layers=4, num_kv_heads=8, head_dim=64, num_blocks=256,
                           window_size=512),
        ],
    )
    mgr = KVCacheManager(cfg)
    match = mgr.add_request("r1", prompt_tokens)      # per-group reuse boundaries
    mgr.write_kv("r1", layer, k, v, start=match.groups[gid].matched_tokens)
    mgr.append_tokens("r1", [next_token])
    batch = mgr.flush_events()                         # EventBatch | None, once per iteration
    mgr.free_request("r1")

Tiers (``host_tier=HostTierConfig()``, ``disk_tier=DiskTierConfig(path, capacity_bytes)``)
keep evicted blocks on the host and on disk (shared by processes) and bring them back on a
prefix hit; ``export_kv``/``begin_import``/``finish_import`` (or :func:`transfer_request`)
move a request's K/V to another manager, sending only what the receiver lacks per group.

Modules: :mod:`.config`, :mod:`.manager` (the manager), :mod:`.block_pool`,
:mod:`.free_queue`, :mod:`.prefix_tree`, :mod:`.block` (pool internals), :mod:`.plan`
(all-or-nothing planning of an operation), :mod:`.windows` (sliding-window arithmetic),
:mod:`.request` (request state and match results), :mod:`.tier_config`, :mod:`.tiering`
(moves between GPU, host and disk), :mod:`.host_tier`, :mod:`.disk_store` and
:mod:`.block_file` (the shared directory of block files), :mod:`.transfer` (K/V transfer),
:mod:`.storage` (torch tensors, imported lazily: a metadata-only manager never imports
torch), :mod:`.stats`, :mod:`.errors`.
"""

from kvstream.cache.config import DTYPES, CacheConfig, LayerGroupSpec
from kvstream.cache.disk_store import DiskStore, DiskStoreStats
from kvstream.cache.errors import (
    BlockFileError,
    CacheError,
    CacheFullError,
    CacheInvariantError,
    DuplicateRequestError,
    KVAccessError,
    RequestError,
    StoreError,
    StoreFullError,
    TransferError,
    UnknownRequestError,
)
from kvstream.cache.manager import HashedPrompt, KVCacheManager
from kvstream.cache.request import GroupMatch, MmItem, PrefixMatch
from kvstream.cache.stats import CacheStats, GroupStats
from kvstream.cache.tier_config import DiskTierConfig, HostTierConfig
from kvstream.cache.tiering import TierStats
from kvstream.cache.transfer import (
    GroupTransfer,
    ImportResult,
    ImportTicket,
    KVTransfer,
    TokenRange,
    transfer_request,
)

__all__ = [
    "DTYPES",
    "BlockFileError",
    "CacheConfig",
    "CacheError",
    "CacheFullError",
    "CacheInvariantError",
    "CacheStats",
    "DiskStore",
    "DiskStoreStats",
    "DiskTierConfig",
    "DuplicateRequestError",
    "GroupMatch",
    "GroupStats",
    "GroupTransfer",
    "HashedPrompt",
    "HostTierConfig",
    "ImportResult",
    "ImportTicket",
    "KVAccessError",
    "KVCacheManager",
    "KVTransfer",
    "LayerGroupSpec",
    "MmItem",
    "PrefixMatch",
    "RequestError",
    "StoreError",
    "StoreFullError",
    "TierStats",
    "TokenRange",
    "TransferError",
    "UnknownRequestError",
    "transfer_request",
]

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

Modules: :mod:`.config`, :mod:`.manager` (the manager), :mod:`.block_pool`,
:mod:`.free_queue`, :mod:`.prefix_tree`, :mod:`.block` (pool internals), :mod:`.plan`
(all-or-nothing planning of an operation), :mod:`.windows` (sliding-window arithmetic),
:mod:`.request` (request state and match results),
:mod:`.storage` (torch tensors, imported lazily: a metadata-only manager never imports
torch), :mod:`.stats`, :mod:`.errors`.
"""

from kvstream.cache.config import DTYPES, CacheConfig, LayerGroupSpec
from kvstream.cache.errors import (
    CacheError,
    CacheFullError,
    CacheInvariantError,
    DuplicateRequestError,
    KVAccessError,
    RequestError,
    UnknownRequestError,
)
from kvstream.cache.manager import KVCacheManager
from kvstream.cache.request import GroupMatch, MmItem, PrefixMatch
from kvstream.cache.stats import CacheStats, GroupStats

__all__ = [
    "DTYPES",
    "CacheConfig",
    "CacheError",
    "CacheFullError",
    "CacheInvariantError",
    "CacheStats",
    "DuplicateRequestError",
    "GroupMatch",
    "GroupStats",
    "KVAccessError",
    "KVCacheManager",
    "LayerGroupSpec",
    "MmItem",
    "PrefixMatch",
    "RequestError",
    "UnknownRequestError",
]

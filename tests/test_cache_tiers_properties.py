"""Hypothesis state machine over a manager with a host and a disk tier.

After every step: the manager's invariants hold, and replaying every event so far (stored ->
level 0, updated -> its new level, removed -> gone) reproduces exactly where the manager
says each block is (GPU tree, host tier, disk). Every running request's K/V equals what the
deterministic model computes, whichever tiers its reused blocks travelled through.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_model import assert_kv, expected_kv, prefill

from kvstream.cache import (
    CacheConfig,
    CacheFullError,
    DiskTierConfig,
    HostTierConfig,
    KVCacheManager,
    LayerGroupSpec,
)
from kvstream.clock import ManualClock
from kvstream.events import SourceId

TPB = 2
SPEC = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 2}
PREFIXES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5]]
WINDOWS = (None, 4)


class TieredCache(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvstream-sm-"))
        groups = [LayerGroupSpec(num_blocks=10, window_size=w, **SPEC) for w in WINDOWS]
        file_bytes = 96 + groups[0].block_bytes(TPB)
        cfg = CacheConfig(
            tokens_per_block=TPB,
            groups=groups,
            hash_algo="blake3_64",
            host_tier=HostTierConfig(blocks=[3, 2]),
            disk_tier=DiskTierConfig(self.dir, capacity_bytes=6 * file_bytes),
        )
        self.mgr = KVCacheManager(cfg, source=SourceId(instance_id="sm"), clock=ManualClock())
        self.levels: list[dict[bytes, int]] = [{}, {}]
        self.tokens: dict[str, list[int]] = {}
        self.n = 0

    def teardown(self) -> None:
        self.mgr.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _replay(self) -> None:
        batch = self.mgr.flush_events()
        for e in [] if batch is None else batch.events:
            d = e.data
            lv = self.levels[e.layer_group_id]
            if d.type == "stored":
                for b in d.blocks:
                    assert b.block_hash not in lv, "stored twice without a removal"
                    lv[b.block_hash] = b.cache_level
            elif d.type == "removed":
                for h in d.block_hashes:
                    assert lv.pop(h) == d.cache_level
            elif d.type == "updated":
                assert d.cache_level is not None
                assert lv[d.block_hash] == d.cache_level.old_value
                lv[d.block_hash] = d.cache_level.new_value

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=5))
    def add(self, prefix: list[int], tail: list[int]) -> None:
        rid = f"r{self.n}"
        self.n += 1
        tokens = prefix + tail
        try:
            prefill(self.mgr, rid, tokens)
        except CacheFullError:
            return
        self.tokens[rid] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def append(self, data: st.DataObject, extra: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        before = len(self.tokens[rid])
        try:
            self.mgr.append_tokens(rid, extra)
        except CacheFullError:
            return
        tokens = self.tokens[rid] = self.tokens[rid] + extra
        for layer in range(2):
            k, v = expected_kv(tokens, layer, 1, 2, before)
            self.mgr.write_kv(rid, layer, k, v, start=before)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        del self.tokens[rid]
        self.mgr.free_request(rid)

    @invariant()
    def consistent(self) -> None:
        self.mgr.check_invariants()
        self._replay()
        for gid in (0, 1):
            want = dict.fromkeys(self.mgr.cached_hashes(gid), 0)
            want.update(dict.fromkeys(self.mgr.host_hashes(gid), 1))
            want.update(dict.fromkeys(self.mgr.disk_hashes(gid), 2))
            assert self.levels[gid] == want
        for rid, tokens in self.tokens.items():
            assert_kv(self.mgr, rid, tokens)


TestTieredCache = TieredCache.TestCase
TestTieredCache.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

"""Hypothesis state machine over random add/append/free/reset/flush sequences.

Checks after every step that reference counts equal the running requests' holdings, free
counts are conserved and the free lists and prefix trees are consistent (no block leaked or
double-freed); that a CacheFullError changes nothing; and at every flush that replaying all
events so far into a plain per-group set of hashes reproduces exactly each group's cached
blocks.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvstream.cache import CacheConfig, CacheFullError, KVCacheManager, LayerGroupSpec
from kvstream.clock import ManualClock
from kvstream.events import EventBatch, SourceId

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5]]
TOKENS = st.integers(0, 3)
GROUPS = [
    LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=12),
    LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=9, window_size=4),
    LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=7, window_size=7),
]


def state_of(mgr: KVCacheManager) -> Any:
    return (
        {
            rid: (
                mgr.num_tokens(rid),
                mgr.block_hashes(rid),
                [mgr.block_ids(rid, g) for g in (0, 1, 2)],
            )
            for rid in mgr.request_ids()
        },
        [mgr.cached_hashes(g) for g in (0, 1, 2)],
        [(g.free_blocks, g.evictable_blocks, g.evictions) for g in mgr.stats().groups],
        mgr.recorder.stats(),  # type: ignore[attr-defined]
    )


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        cfg = CacheConfig(
            tokens_per_block=2, groups=GROUPS, hash_algo="blake3_64", metadata_only=True
        )
        self.mgr = KVCacheManager(cfg, source=SourceId(instance_id="sm"), clock=ManualClock())
        self.index: list[set[bytes]] = [set(), set(), set()]
        self.next_event_id = 0
        self.counter = 0

    def _replay(self, batch: EventBatch | None) -> None:
        for ev in batch.events if batch is not None else ():
            assert ev.event_id == self.next_event_id
            self.next_event_id += 1
            idx = self.index[ev.layer_group_id]
            d = ev.data
            if d.type == "stored":
                parent = d.parent_hash
                for b in d.blocks:
                    assert b.block_hash not in idx, "announced twice"
                    if ev.layer_group_id == 0 and parent is not None:
                        assert parent in idx, "full-attention block stored under an unknown parent"
                    idx.add(b.block_hash)
                    parent = b.block_hash
            elif d.type == "removed":
                for h in d.block_hashes:
                    assert h in idx, "removal of a block never announced"
                    idx.remove(h)
            elif d.type == "cleared":
                idx.clear()
            else:
                assert d.type == "created", f"unexpected {d.type} event"

    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.integers(0, 8),
        tail=st.lists(TOKENS, max_size=7),
        lora=st.sampled_from([None, None, 7]),
        salt=st.sampled_from([None, None, "tenant"]),
    )
    def add(
        self, prefix: list[int], cut: int, tail: list[int], lora: int | None, salt: str | None
    ) -> None:
        prompt = prefix[:cut] + tail or [0]
        rid = f"r{self.counter}"
        self.counter += 1
        before = state_of(self.mgr)
        try:
            m = self.mgr.add_request(rid, prompt, lora_id=lora, cache_salt=salt)
        except CacheFullError:
            assert state_of(self.mgr) == before
            return
        assert m.reusable_tokens <= len(prompt) - 1
        for g in m.groups:
            assert g.matched_tokens % 2 == 0

    @precondition(lambda self: bool(self.mgr.request_ids()))
    @rule(data=st.data(), tokens=st.lists(TOKENS, min_size=1, max_size=5))
    def append(self, data: st.DataObject, tokens: list[int]) -> None:
        rid = data.draw(st.sampled_from(self.mgr.request_ids()))
        before = state_of(self.mgr)
        n = self.mgr.num_tokens(rid)
        try:
            self.mgr.append_tokens(rid, tokens)
        except CacheFullError:
            assert state_of(self.mgr) == before
            return
        assert self.mgr.num_tokens(rid) == n + len(tokens)

    @precondition(lambda self: bool(self.mgr.request_ids()))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.mgr.request_ids()))
        self.mgr.free_request(rid)

    @rule()
    def reset(self) -> None:
        self.mgr.reset()
        assert all(self.mgr.num_free_blocks(g) == GROUPS[g].num_blocks for g in (0, 1, 2))

    @rule()
    def flush(self) -> None:
        self._replay(self.mgr.flush_events())
        for g in (0, 1, 2):
            assert self.index[g] == self.mgr.cached_hashes(g)

    @invariant()
    def consistent(self) -> None:
        self.mgr.check_invariants()

    def teardown(self) -> None:
        for rid in self.mgr.request_ids():
            self.mgr.free_request(rid)
        self.mgr.check_invariants()
        for g in (0, 1, 2):
            assert self.mgr.num_free_blocks(g) == GROUPS[g].num_blocks
        self._replay(self.mgr.flush_events())
        for g in (0, 1, 2):
            assert self.index[g] == self.mgr.cached_hashes(g)


def test_cache_state_machine() -> None:
    run_state_machine_as_test(
        CacheMachine,
        settings=settings(
            max_examples=150,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )

"""Host and disk tiers of the cache manager: exact event sequences, bit-identical K/V through
every tier, automatic host sizing, multimodal separation, and the consumer's view."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kv_model import assert_kv, prefill

from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec, MmItem
from kvstream.cache.tier_config import DiskTierConfig, HostTierConfig, size_host_tier
from kvstream.clock import ManualClock
from kvstream.errors import ConfigError
from kvstream.events import EventBatch, SourceId
from kvstream.index import PrefixIndex

TPB = 4
SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4}


def make(
    gpu: int = 4,
    host: int | None = 4,
    *,
    disk: Path | None = None,
    disk_blocks: int = 64,
    write_through: bool = False,
    windows: tuple[int | None, ...] = (None,),
    metadata_only: bool = False,
    instance: str = "w",
) -> KVCacheManager:
    groups = [LayerGroupSpec(num_blocks=gpu, window_size=w, **SPEC) for w in windows]
    block_bytes = groups[0].block_bytes(TPB)
    cfg = CacheConfig(
        tokens_per_block=TPB,
        groups=groups,
        hash_algo="blake3_64",
        metadata_only=metadata_only,
        host_tier=None if host is None else HostTierConfig(blocks=[host] * len(groups)),
        disk_tier=None
        if disk is None
        else DiskTierConfig(
            disk,
            capacity_bytes=max(1, disk_blocks * (block_bytes + 96)),
            write_through=write_through,
        ),
    )
    return KVCacheManager(cfg, source=SourceId(instance_id=instance), clock=ManualClock())


def events(mgr: KVCacheManager) -> list[tuple[Any, ...]]:
    """The flushed events as ``(kind, details)`` tuples, hashes as block indices where the
    test registered names (see ``names``)."""
    batch = mgr.flush_events()
    out: list[tuple[Any, ...]] = []
    for e in [] if batch is None else batch.events:
        d = e.data
        if d.type == "stored":
            out.append(
                (
                    "stored",
                    e.layer_group_id,
                    [b.block_hash for b in d.blocks],
                    d.blocks[0].cache_level,
                )
            )
        elif d.type == "removed":
            out.append(("removed", e.layer_group_id, list(d.block_hashes), d.cache_level))
        elif d.type == "updated":
            assert d.cache_level is not None
            out.append(
                (
                    "updated",
                    e.layer_group_id,
                    d.block_hash,
                    (d.cache_level.old_value, d.cache_level.new_value),
                )
            )
        else:
            out.append((d.type, e.layer_group_id))
    return out


def toks(base: int, n: int) -> list[int]:
    return [base + i for i in range(n)]


# --------------------------------------------------------------------------- host tier


def test_created_reports_every_level(tmp_path: Path) -> None:
    mgr = make(gpu=4, host=6, disk=tmp_path, disk_blocks=10)
    (created,) = mgr.flush_events().events  # type: ignore[union-attr]
    assert created.data.num_blocks_per_cache_level == (4, 6, 10)  # type: ignore[union-attr]
    assert make(gpu=4, host=3).flush_events().events[0].data.num_blocks_per_cache_level == (4, 3)  # type: ignore[union-attr]


def test_gpu_eviction_moves_blocks_to_host_in_lru_order_and_back() -> None:
    mgr = make(gpu=4, host=4)
    events(mgr)
    a = toks(1, 13)  # 3 full blocks + 1 token
    prefill(mgr, "a", a)
    ha = mgr.block_hashes("a")
    mgr.free_request("a")
    assert events(mgr) == [("stored", 0, ha, 0)]
    b = toks(100, 13)
    prefill(mgr, "b", b)
    hb = mgr.block_hashes("b")
    mgr.free_request("b")
    # a's blocks were released last position first, so they leave the GPU in that order.
    assert events(mgr) == [
        ("updated", 0, ha[2], (0, 1)),
        ("updated", 0, ha[1], (0, 1)),
        ("updated", 0, ha[0], (0, 1)),
        ("stored", 0, hb, 0),
    ]
    assert mgr.host_hashes(0) == [ha[2], ha[1], ha[0]]
    match = mgr.add_request("a2", a)
    assert match.groups[0].matched_tokens == 12
    assert match.groups[0].onboarded_blocks == 3
    ev = events(mgr)
    # Room for a2: b's blocks go down (the host has one free slot while a's are onboarded,
    # so each newcomer pushes the previous one out), then a's come back in prefix order.
    assert ev == [
        ("updated", 0, hb[2], (0, 1)),
        ("removed", 0, [hb[2]], 1),
        ("updated", 0, hb[1], (0, 1)),
        ("removed", 0, [hb[1]], 1),
        ("updated", 0, hb[0], (0, 1)),
        ("updated", 0, ha[0], (1, 0)),
        ("updated", 0, ha[1], (1, 0)),
        ("updated", 0, ha[2], (1, 0)),
    ]
    mgr.write_kv("a2", 0, *_kv_tail(a, 0), start=12)
    mgr.write_kv("a2", 1, *_kv_tail(a, 1), start=12)
    assert_kv(mgr, "a2", a)
    mgr.check_invariants()
    st = mgr.stats().groups[0].tier
    assert st is not None
    assert (st.offloaded_to_host, st.onboarded_from_host, st.dropped) == (6, 3, 2)


def _kv_tail(tokens: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    from kv_model import expected_kv

    k, v = expected_kv(tokens, layer, SPEC["num_kv_heads"], SPEC["head_dim"], 12)
    return k, v


def test_host_full_drops_its_oldest_block() -> None:
    mgr = make(gpu=3, host=1)
    events(mgr)
    prefill(mgr, "a", toks(1, 9))
    ha = mgr.block_hashes("a")
    mgr.free_request("a")
    prefill(mgr, "b", toks(50, 9))
    hb = mgr.block_hashes("b")
    mgr.free_request("b")
    assert events(mgr) == [
        ("stored", 0, ha, 0),
        ("updated", 0, ha[1], (0, 1)),
        ("removed", 0, [ha[1]], 1),
        ("updated", 0, ha[0], (0, 1)),
        ("stored", 0, hb, 0),
    ]


def test_a_recomputed_block_held_on_host_is_promoted_not_stored_again() -> None:
    mgr = make(gpu=3, host=4)
    a = toks(1, 8)
    prefill(mgr, "a", [*a, 99])
    ha = mgr.block_hashes("a")
    mgr.free_request("a")
    prefill(mgr, "x", toks(50, 9))  # pushes a's blocks to the host
    mgr.free_request("x")
    events(mgr)
    # b reuses block 0 from the host; its block 1 fills only when token 8 is appended.
    prefill(mgr, "b", a[:7])
    mgr.append_tokens("b", [a[7]])
    ev = events(mgr)
    assert ("updated", 0, ha[0], (1, 0)) in ev
    assert ev[-1] == ("updated", 0, ha[1], (1, 0))
    assert not [e for e in ev if e[0] == "stored"]
    assert ha[1] not in mgr.host_hashes(0)
    mgr.check_invariants()


def test_metadata_only_host_tier_records_the_same_events() -> None:
    def run(meta: bool) -> list[tuple[Any, ...]]:
        mgr = make(gpu=4, host=3, metadata_only=meta)
        for i, base in enumerate((1, 100, 1, 200, 100)):
            mgr.add_request(f"r{i}", toks(base, 10))
            mgr.free_request(f"r{i}")
        mgr.check_invariants()
        return events(mgr)

    assert run(True) == run(False)


def test_auto_host_sizing_follows_the_gpu_pool_and_caps_at_host_memory() -> None:
    cfg = HostTierConfig(ratio=2.0, max_memory_fraction=0.5)
    assert size_host_tier(cfg, [10, 20], [100, 50], available_bytes=10**9) == [20, 40]
    # 20*100 + 40*50 = 4000 bytes wanted, 1000 allowed: every group scaled by 1/4.
    assert size_host_tier(cfg, [10, 20], [100, 50], available_bytes=2000) == [5, 10]
    assert size_host_tier(HostTierConfig(blocks=[3, 0]), [10, 20], [1, 1], 0) == [3, 0]
    with pytest.raises(ConfigError, match="2 entries for 1"):
        size_host_tier(HostTierConfig(blocks=[3, 0]), [10], [1], 0)
    groups = [LayerGroupSpec(num_blocks=8, **SPEC)]
    mgr = KVCacheManager(
        CacheConfig(tokens_per_block=TPB, groups=groups, host_tier=HostTierConfig())
    )
    created = mgr.flush_events().events[0].data  # type: ignore[union-attr]
    assert created.num_blocks_per_cache_level == (8, 8)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"blocks": "many"}, "host_tier.blocks"),
        ({"blocks": [-1]}, r"host_tier.blocks\[0\]"),
        ({"ratio": 0}, "host_tier.ratio"),
        ({"max_memory_fraction": 1.5}, "max_memory_fraction"),
        ({"pinned": "yes"}, "pinned"),
    ],
)
def test_bad_host_tier_config(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        HostTierConfig(**kwargs)


def test_bad_disk_tier_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="capacity_bytes"):
        DiskTierConfig(tmp_path, capacity_bytes=0)
    with pytest.raises(ConfigError, match="metadata_only"):
        CacheConfig(
            tokens_per_block=TPB,
            groups=[LayerGroupSpec(num_blocks=4, **SPEC)],
            metadata_only=True,
            disk_tier=DiskTierConfig(tmp_path, capacity_bytes=10**6),
        )
    with pytest.raises(ConfigError, match="2 entries for 1"):
        CacheConfig(
            tokens_per_block=TPB,
            groups=[LayerGroupSpec(num_blocks=4, **SPEC)],
            host_tier=HostTierConfig(blocks=[1, 2]),
        )


def test_multimodal_blocks_are_reused_through_the_host_tier_only_for_equal_bytes() -> None:
    mgr = make(gpu=4, host=8)
    prompt = [7] * 12 + [1]  # 12 placeholder tokens, then text
    cat, dog = b"cat image bytes", b"dog image bytes"
    prefill(mgr, "a", prompt, mm_items=[(cat, 0, 12)])
    mgr.free_request("a")
    prefill(mgr, "x", toks(300, 13))  # a's blocks go to the host
    mgr.free_request("x")
    assert len(mgr.host_hashes(0)) == 3
    miss = mgr.match_prefix(prompt, mm_items=[(dog, 0, 12)])
    assert miss.groups[0].matched_tokens == 0
    hit = mgr.add_request("b", prompt, mm_items=[MmItem.from_content(cat, 0, 12)])
    assert (hit.groups[0].matched_tokens, hit.groups[0].onboarded_blocks) == (12, 3)


def test_index_follows_blocks_across_tiers() -> None:
    mgr = make(gpu=4, host=4)
    index = PrefixIndex()
    a = toks(1, 13)
    prefill(mgr, "a", a)
    mgr.free_request("a")
    prefill(mgr, "b", toks(100, 13))
    mgr.free_request("b")
    batch = mgr.flush_events()
    assert isinstance(batch, EventBatch)
    index.apply(batch)
    (m,) = index.match(a, tokens_per_block=TPB).matches
    assert m.matched_blocks == 3
    assert m.weighted_blocks < 3  # on the host: weighted below the GPU


# --------------------------------------------------------------------------- disk tier


def test_host_overflow_goes_to_disk_and_comes_back_bit_identical(tmp_path: Path) -> None:
    mgr = make(gpu=3, host=1, disk=tmp_path)
    events(mgr)
    a = toks(1, 9)
    prefill(mgr, "a", a)
    ha = mgr.block_hashes("a")
    mgr.free_request("a")
    prefill(mgr, "b", toks(50, 9))
    hb = mgr.block_hashes("b")
    mgr.free_request("b")
    assert events(mgr) == [
        ("stored", 0, ha, 0),
        ("updated", 0, ha[1], (0, 1)),
        ("updated", 0, ha[1], (1, 2)),
        ("updated", 0, ha[0], (0, 1)),
        ("stored", 0, hb, 0),
    ]
    assert mgr.disk_hashes(0) == {ha[1]}
    match = mgr.add_request("a2", a)
    assert (match.groups[0].matched_tokens, match.groups[0].onboarded_blocks) == (8, 2)
    ev = events(mgr)
    assert ev[-2:] == [("updated", 0, ha[0], (1, 0)), ("updated", 0, ha[1], (2, 0))]
    assert_kv(mgr, "a2", a[:8])
    mgr.check_invariants()
    st = mgr.stats()
    assert st.disk is not None
    assert st.disk.hits == 1
    tier = st.groups[0].tier
    assert tier is not None
    assert (tier.onboarded_from_host, tier.onboarded_from_disk) == (1, 1)


def test_without_a_host_tier_gpu_evictions_go_straight_to_disk(tmp_path: Path) -> None:
    mgr = make(gpu=3, host=None, disk=tmp_path)
    assert mgr.flush_events().events[0].data.num_blocks_per_cache_level == (3, 0, 64)  # type: ignore[union-attr]
    prefill(mgr, "a", toks(1, 9))
    ha = mgr.block_hashes("a")
    mgr.free_request("a")
    prefill(mgr, "b", toks(50, 9))
    mgr.free_request("b")
    ev = events(mgr)
    assert ev[1:3] == [("updated", 0, ha[1], (0, 2)), ("updated", 0, ha[0], (0, 2))]


def test_disk_capacity_evicts_the_oldest_file_with_a_removed_event(tmp_path: Path) -> None:
    mgr = make(gpu=2, host=None, disk=tmp_path, disk_blocks=2)
    hashes = []
    for i in range(4):
        prefill(mgr, f"r{i}", toks(100 * i + 1, 5))
        hashes.append(mgr.block_hashes(f"r{i}")[0])
        mgr.free_request(f"r{i}")
    ev = events(mgr)
    assert ("removed", 0, [hashes[0]], 2) in ev
    assert mgr.disk_hashes(0) == {hashes[1], hashes[2]}
    st = mgr.stats().disk
    assert st is not None
    assert st.files == 2
    assert st.evictions == 1


def test_a_corrupt_or_missing_disk_block_is_a_miss_never_loaded(tmp_path: Path) -> None:
    mgr = make(gpu=3, host=None, disk=tmp_path)
    a = toks(1, 9)
    prefill(mgr, "a", a)
    ha = mgr.block_hashes("a")
    mgr.free_request("a")
    prefill(mgr, "b", toks(50, 9))
    mgr.free_request("b")
    events(mgr)
    store = mgr._tiers.disk  # type: ignore[union-attr]
    assert store is not None
    ns = mgr._tiers._groups[0].namespace  # type: ignore[union-attr]
    path = Path(store.path(ns, ha[1]))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of K/V
    path.write_bytes(bytes(data))
    match = mgr.add_request("a2", a)
    # Block 0 still comes from disk; block 1 is corrupt: recomputed, and announced as gone.
    assert (match.groups[0].matched_tokens, match.groups[0].onboarded_blocks) == (4, 1)
    ev = events(mgr)
    assert ("removed", 0, [ha[1]], 2) in ev
    assert ("updated", 0, ha[0], (2, 0)) in ev
    assert not path.exists()
    st = mgr.stats()
    assert st.disk is not None
    assert st.disk.corrupt == 1
    assert st.groups[0].tier is not None
    assert st.groups[0].tier.disk_misses == 1
    # Another process deleted a file this manager announced: also a miss with a removal.
    mgr.free_request("a2")
    prefill(mgr, "c", toks(900, 9))
    mgr.free_request("c")
    events(mgr)
    for h in mgr.disk_hashes(0):
        Path(store.path(ns, h)).unlink()
    gone = mgr.disk_hashes(0)
    mgr.add_request("a3", a)
    ev = events(mgr)
    removed = {h for e in ev if e[0] == "removed" and e[3] == 2 for h in e[2]}
    promoted = {e[2] for e in ev if e[0] == "updated" and e[3] == (2, 0)}
    # The first missing block is found gone (removed); later ones, recomputed, come up.
    assert ha[0] in removed
    assert gone & set(mgr.block_hashes("a3")) <= removed | promoted
    assert not mgr.disk_hashes(0) & set(mgr.block_hashes("a3"))
    mgr.check_invariants()


def test_a_full_disk_drops_the_block_with_a_clear_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A store smaller than one block file: every write fails with StoreFullError.
    mgr = make(gpu=2, host=None, disk=tmp_path / "store", disk_blocks=0)
    prefill(mgr, "a", toks(1, 5))
    h = mgr.block_hashes("a")[0]
    mgr.free_request("a")
    events(mgr)
    with caplog.at_level("WARNING", logger="kvstream.cache.tiering"):
        prefill(mgr, "b", toks(50, 5))
    assert events(mgr)[0] == ("removed", 0, [h], 0)
    assert "not written" in caplog.text
    tier = mgr.stats().groups[0].tier
    assert tier is not None
    assert tier.disk_write_errors == 1
    assert not [p for p in (tmp_path / "store").rglob("*") if p.is_file()]


def test_write_through_shares_blocks_still_on_the_gpu(tmp_path: Path) -> None:
    first = make(gpu=8, host=None, disk=tmp_path, write_through=True, instance="one")
    a = toks(1, 13)
    prefill(first, "a", a)
    assert first.persist() == 3
    assert first.persist() == 0
    tier = first.stats().groups[0].tier
    assert tier is not None
    assert tier.persisted == 3
    second = make(gpu=8, host=None, disk=tmp_path, instance="two")
    events(second)
    match = second.add_request("a", a)
    assert (match.groups[0].matched_tokens, match.groups[0].onboarded_blocks) == (12, 3)
    # Blocks second never announced: one stored event at the GPU level, chained as usual.
    ev = events(second)
    assert ev == [("stored", 0, first.block_hashes("a"), 0)]
    second.write_kv("a", 0, *_kv_tail(a, 0), start=12)
    second.write_kv("a", 1, *_kv_tail(a, 1), start=12)
    assert_kv(second, "a", a)


def test_models_sharing_a_directory_never_share_blocks(tmp_path: Path) -> None:
    def manager(model: str) -> KVCacheManager:
        groups = [LayerGroupSpec(num_blocks=8, **SPEC)]
        return KVCacheManager(
            CacheConfig(
                tokens_per_block=TPB,
                groups=groups,
                hash_algo="blake3_64",
                disk_tier=DiskTierConfig(
                    tmp_path, capacity_bytes=10**7, model_id=model, write_through=True
                ),
            )
        )

    a = toks(1, 9)
    one = manager("llama")
    prefill(one, "a", a)
    one.persist()
    assert manager("llama").match_prefix(a).groups[0].matched_tokens == 8
    assert manager("mistral").match_prefix(a).groups[0].matched_tokens == 0


def test_multimodal_blocks_on_disk_are_reused_only_for_equal_bytes(tmp_path: Path) -> None:
    prompt = [7] * 8 + [1]
    one = make(gpu=8, host=None, disk=tmp_path, write_through=True)
    prefill(one, "a", prompt, mm_items=[(b"cat", 0, 8)])
    one.persist()
    two = make(gpu=8, host=None, disk=tmp_path)
    assert two.match_prefix(prompt, mm_items=[(b"dog", 0, 8)]).groups[0].matched_tokens == 0
    assert two.match_prefix(prompt, mm_items=[(b"cat", 0, 8)]).groups[0].matched_tokens == 8


_PROCESS = """
import json, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from kv_model import assert_kv, prefill
from test_cache_tiers import make, toks
role, store = sys.argv[1], Path(sys.argv[2])
tokens = toks(1, 4 * 6 + 1)
mgr = make(gpu=8, host=2, disk=store, instance=role)
if role == "writer":
    prefill(mgr, "a", tokens)
    ha = mgr.block_hashes("a")
    mgr.free_request("a")
    for i in range(3):  # push everything down: GPU -> host -> disk
        prefill(mgr, f"x{{i}}", toks(1000 * (i + 1), 29))
        mgr.free_request(f"x{{i}}")
    print(json.dumps(sorted(h.hex() for h in ha if h in mgr.disk_hashes(0))))
else:
    mgr.flush_events()
    match = mgr.add_request("a", tokens)
    assert_kv(mgr, "a", tokens[: match.groups[0].matched_tokens])
    batch = mgr.flush_events()
    stored = [b.block_hash.hex() for e in batch.events if e.data.type == "stored"
              for b in e.data.blocks]
    print(json.dumps([match.groups[0].matched_tokens, match.groups[0].onboarded_blocks, stored]))
mgr.close()
"""


def test_a_second_process_reuses_the_first_ones_blocks(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    script = _PROCESS.format(tests=str(Path(__file__).parent))

    def run(role: str) -> Any:
        out = subprocess.run(
            [sys.executable, "-c", script, role, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    on_disk = run("writer")  # the writer's 6 full prompt blocks all reached the disk
    assert len(on_disk) == 6
    matched, onboarded, stored = run("reader")
    assert (matched, onboarded) == (24, 6)
    # The reader announces what it found (it never announced those blocks itself).
    assert sorted(stored) == on_disk


# --------------------------------------------------------------------------- pieces


@given(
    pairs=st.lists(
        st.tuples(st.integers(0, 15), st.integers(0, 15)), unique_by=lambda p: p[0], max_size=12
    ),
    run=st.tuples(st.integers(0, 8), st.integers(0, 8), st.integers(0, 8), st.booleans()),
)
def test_copy_blocks_moves_every_pair_whatever_the_runs(
    pairs: list[tuple[int, int]], run: tuple[int, int, int, bool]
) -> None:
    from kvstream.cache.storage import copy_blocks

    d0, s0, n, down = run
    if pairs:
        dst_ids, src_ids = [p[0] for p in pairs], [p[1] for p in pairs]
    else:  # a consecutive run, ascending or descending on both sides
        dst_ids, src_ids = list(range(d0, d0 + n)), list(range(s0, s0 + n))
        if down:
            dst_ids, src_ids = dst_ids[::-1], src_ids[::-1]
    src = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)
    dst = torch.zeros(16, 3)
    want = dst.clone()
    for d, s in zip(dst_ids, src_ids, strict=True):
        want[d] = src[s]
    copy_blocks(dst, dst_ids, src, src_ids)
    assert torch.equal(dst, want)


def test_host_tier_slot_states() -> None:
    from kvstream.cache.errors import CacheInvariantError
    from kvstream.cache.host_tier import HostTier

    tier = HostTier(3)
    slots = [tier.add(h) for h in (b"a", b"b", b"c")]
    assert slots == [2, 1, 0]  # descending, like the ids a pool evicts
    assert tier.num_free == 0
    assert tier.pop_lru() == (b"a", 2)
    assert tier.take(b"c") == 0
    assert tier.hashes() == [b"b"]
    tier.check()
    with pytest.raises(CacheInvariantError):
        tier.add(b"d")  # slots 2 and 0 are taken, not free
    tier.release(2)
    assert tier.add(b"d") == 2
    with pytest.raises(CacheInvariantError):
        tier.release(1)  # resident, not taken
    with pytest.raises(CacheInvariantError):
        tier.take(b"zz")
    tier.clear()
    assert (len(tier), tier.num_free) == (0, 3)

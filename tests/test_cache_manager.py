"""The KV-cache manager: requests, per-group reuse boundaries, pressure, K/V round trips."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvstream.cache import (
    CacheConfig,
    CacheFullError,
    DuplicateRequestError,
    KVAccessError,
    KVCacheManager,
    LayerGroupSpec,
    RequestError,
    UnknownRequestError,
)
from kvstream.clock import ManualClock
from kvstream.errors import HashingError, KVStreamError
from kvstream.events import SourceId

T = 4
HEADS, DIM = 2, 8
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def spec(num_blocks: int, window: int | None = None, layers: int = 2, **kw: Any) -> LayerGroupSpec:
    return LayerGroupSpec(
        num_layers=layers,
        num_kv_heads=HEADS,
        head_dim=DIM,
        num_blocks=num_blocks,
        window_size=window,
        **kw,
    )


def make(
    *groups: LayerGroupSpec, metadata_only: bool = False, device: str = "cpu"
) -> KVCacheManager:
    cfg = CacheConfig(
        tokens_per_block=T,
        groups=groups,
        hash_algo="blake3_64",
        device=device,
        metadata_only=metadata_only,
    )
    return KVCacheManager(cfg, source=SourceId(instance_id="t"), clock=ManualClock())


def snapshot(mgr: KVCacheManager) -> dict[str, Any]:
    """Everything observable about the manager's state."""
    stats = mgr.stats()
    return {
        "requests": {
            rid: (
                mgr.num_tokens(rid),
                mgr.block_hashes(rid),
                [mgr.block_ids(rid, g) for g in range(mgr.num_groups)],
            )
            for rid in mgr.request_ids()
        },
        "cached": [mgr.cached_hashes(g) for g in range(mgr.num_groups)],
        "groups": [
            (g.free_blocks, g.evictable_blocks, g.cached_blocks, g.evictions) for g in stats.groups
        ],
        "emitter": mgr.recorder.stats(),  # type: ignore[attr-defined]
    }


def kv(n: int, seed: int, dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, HEADS, DIM, generator=g).to(dtype),
        torch.randn(n, HEADS, DIM, generator=g).to(dtype),
    )


# ---------------------------------------------------------------------- requests


def test_add_append_free_lifecycle_and_stats() -> None:
    mgr = make(spec(16))
    m = mgr.add_request("a", list(range(10)))
    assert m.reusable_tokens == 0
    assert m.num_prompt_tokens == 10
    assert mgr.num_tokens("a") == 10
    assert len(mgr.block_ids("a", 0)) == 3
    assert mgr.append_tokens("a", [1]) == 0
    assert mgr.append_tokens("a", [2]) == 1  # fills block 2
    assert mgr.append_tokens("a", []) == 0
    assert mgr.append_tokens("a", list(range(9))) == 2
    assert mgr.num_tokens("a") == 21
    assert len(mgr.block_hashes("a")) == 5
    assert mgr.num_free_blocks(0) == 16 - 6
    mgr.check_invariants()
    mgr.free_request("a")
    mgr.check_invariants()
    st = mgr.stats()
    assert st.running_requests == 0
    assert st.requests_added == 1
    assert st.groups[0].free_blocks == 16
    assert st.groups[0].cached_blocks == 5 == st.groups[0].evictable_blocks
    assert st.groups[0].queried_blocks == 2
    assert st.groups[0].hit_blocks == 0
    assert st.groups[0].miss_blocks == 2
    assert st.groups[0].hit_ratio == 0.0


def test_request_errors() -> None:
    mgr = make(spec(16), metadata_only=True)
    mgr.add_request("a", [1, 2, 3])
    with pytest.raises(DuplicateRequestError):
        mgr.add_request("a", [1])
    with pytest.raises(UnknownRequestError, match="'nope'") as exc:
        mgr.free_request("nope")
    assert isinstance(exc.value, KeyError)
    assert isinstance(exc.value, KVStreamError)
    with pytest.raises(UnknownRequestError):
        mgr.append_tokens("nope", [1])
    with pytest.raises(RequestError, match="token"):
        mgr.append_tokens("a", [2**32])
    with pytest.raises(RequestError, match="at least one"):
        mgr.add_request("b", [])
    with pytest.raises(RequestError, match="priority"):
        mgr.add_request("b", [1], priority=101)
    with pytest.raises(RequestError, match="token"):
        mgr.add_request("b", [-1])
    with pytest.raises(RequestError, match=r"mm_items\[0\]"):
        mgr.add_request("b", [1, 2], mm_items=[(b"img", 1, 5)])
    with pytest.raises(HashingError, match="lora"):
        mgr.add_request("b", [1, 2], lora_name="adapter")  # blake3 names adapters by id
    assert mgr.request_ids() == ["a"]
    mgr.check_invariants()


def test_match_prefix_changes_nothing() -> None:
    mgr = make(spec(16), metadata_only=True)
    mgr.add_request("a", list(range(13)))
    before = snapshot(mgr)
    m = mgr.match_prefix([*list(range(13)), 99])
    assert m.groups[0].matched_tokens == 12
    assert mgr.match_prefix([5, 6, 7, 8, 9]).reusable_tokens == 0
    assert snapshot(mgr) == before


def test_last_prompt_token_is_never_reused() -> None:
    mgr = make(spec(16), metadata_only=True)
    prompt = list(range(8))  # exactly two blocks
    mgr.add_request("a", prompt)
    mgr.free_request("a")
    m = mgr.add_request("b", prompt)
    assert m.groups[0].matched_tokens == 4  # block 1 holds the last token: recomputed
    # B writes block 1 into its own block but also holds the cached one (its chain).
    ids = mgr.block_ids("b", 0)
    assert len(ids) == 2
    mgr.check_invariants()
    assert mgr.num_free_blocks(0) == 16 - 3
    mgr.free_request("b")
    mgr.check_invariants()
    hashes = mgr.match_prefix(prompt)  # nothing changes
    assert hashes.groups[0].matched_tokens == 4
    assert len(mgr.cached_hashes(0)) == 2  # the duplicate was never committed twice
    assert mgr.stats().groups[0].evictable_blocks == 2


def test_concurrent_identical_decodes_share_committed_chain_safely() -> None:
    mgr = make(spec(32), metadata_only=True)
    mgr.add_request("a", [1, 2, 3])
    mgr.add_request("b", [1, 2, 3])
    for t in range(9):
        mgr.append_tokens("a", [t])
        mgr.append_tokens("b", [t])
    assert mgr.block_hashes("a") == mgr.block_hashes("b")
    # Each commit of b duplicates a: b keeps private blocks and pins a's committed ones.
    assert set(mgr.block_ids("a", 0)).isdisjoint(mgr.block_ids("b", 0))
    mgr.check_invariants()
    mgr.free_request("a")  # a's chain stays held by b's pins
    mgr.check_invariants()
    assert mgr.num_free_blocks(0) == 32 - 3 - 3
    mgr.free_request("b")
    mgr.check_invariants()
    assert mgr.stats().groups[0].cached_blocks == 3


# ---------------------------------------------------------------------- windows


def test_swa_releases_out_of_window_blocks_at_append() -> None:
    mgr = make(spec(64), spec(64, window=8), metadata_only=True)
    mgr.add_request("a", list(range(20)))  # 5 blocks; prompt blocks all held until computed
    assert None not in mgr.block_ids("a", 1)
    mgr.append_tokens("a", [1])  # 20 tokens computed: the next one needs [12, 20) -> blocks 3, 4
    assert mgr.block_ids("a", 1)[:3] == [None, None, None]
    assert None not in mgr.block_ids("a", 0)
    mgr.check_invariants()
    for t in range(8):
        mgr.append_tokens("a", [t])
    ids = mgr.block_ids("a", 1)
    assert ids[:5] == [None] * 5
    assert None not in ids[5:]
    assert len(mgr.cached_hashes(1)) == 7  # released blocks stay cached and evictable
    mgr.check_invariants()
    mgr.free_request("a")
    mgr.check_invariants()
    assert mgr.num_free_blocks(1) == 64


def test_short_window_does_not_truncate_full_attention_reuse() -> None:
    """Per-group boundaries: the SWA pool lost the window before the prompt's end, the full
    group keeps its whole match (TensorRT-LLM's single boundary would drop it to 16)."""
    mgr = make(spec(64), spec(6, window=8), metadata_only=True)
    a = list(range(100, 124))  # 6 full blocks
    mgr.add_request("a", a)
    mgr.free_request("a")
    # Pressure on the SWA pool: evicts the two leaves (blocks 5 and 4) there only.
    mgr.add_request("x", [1, 2, 3, 4, 5])
    assert mgr.stats().groups[1].evictions == 2
    assert mgr.stats().groups[0].evictions == 0
    mgr.free_request("x")
    full_before = mgr.cached_hashes(0)

    b = [*a, 7, 7, 7, 7]
    m = mgr.add_request("b", b)
    g_full, g_swa = m.groups
    assert g_full.matched_tokens == 24
    assert g_full.cached_blocks == 6
    # Position 24 needs [16, 24) = blocks 4, 5 (evicted); position 20 needs blocks 3, 4
    # (4 evicted); position 16 needs blocks 2, 3: cached.
    assert g_swa.matched_tokens == 16
    assert g_swa.cached_blocks == 2
    assert m.reusable_tokens == 16
    assert mgr.block_ids("b", 1)[:2] == [None, None]
    assert full_before <= mgr.cached_hashes(0)
    mgr.check_invariants()


def test_swa_reuses_a_window_whose_ancestors_were_evicted() -> None:
    mgr = make(spec(64), spec(6, window=8), metadata_only=True)
    a = list(range(200, 212))  # 3 blocks
    mgr.add_request("a", a)
    for t in range(5):  # at 16 computed tokens blocks 0 and 1 have left the window
        mgr.append_tokens("a", [300 + t])
    assert mgr.block_ids("a", 1)[:2] == [None, None]
    mgr.add_request("x", [1, 2, 3, 4, 5])  # 2 SWA blocks: the never-used one + evicts block 0
    mgr.add_request("y", [6])  # evicts block 1
    mgr.free_request("x")
    mgr.free_request("y")
    swa_cached = mgr.cached_hashes(1)
    ha = mgr.block_hashes("a")
    assert ha[0] not in swa_cached
    assert ha[1] not in swa_cached
    assert ha[2] in swa_cached
    prompt_b = [*a, 300, 301, 302, 303, 9]
    m = mgr.add_request("b", prompt_b)
    # The window before position 16 (blocks 2, 3) is cached: both groups reuse 16 tokens.
    assert [g.matched_tokens for g in m.groups] == [16, 16]
    assert m.groups[1].cached_blocks == 2
    mgr.check_invariants()


# ---------------------------------------------------------------------- pressure


def test_pool_exhaustion_raises_and_changes_nothing() -> None:
    mgr = make(spec(64), spec(6, window=8), metadata_only=True)
    mgr.add_request("a", list(range(12)))
    mgr.free_request("a")
    mgr.add_request("b", list(range(50, 58)))  # holds 2 SWA blocks, 1 cached + 3 free left
    mgr.take_events()
    before = snapshot(mgr)
    with pytest.raises(CacheFullError) as exc:
        mgr.add_request("big", list(range(1000, 1021)))  # 6 blocks: group 0 fits, group 1 not
    assert exc.value.layer_group_id == 1
    assert exc.value.needed == 6
    assert exc.value.available == 4
    assert "nothing was changed" in str(exc.value)
    assert snapshot(mgr) == before
    assert mgr.take_events() is None
    mgr.check_invariants()
    assert mgr.stats().requests_rejected == 1
    # The manager keeps working: a request that fits still fits.
    mgr.add_request("ok", list(range(2000, 2010)))
    mgr.check_invariants()


def test_append_exhaustion_rolls_back_window_release_too() -> None:
    mgr = make(spec(64), spec(4, window=4), metadata_only=True)
    mgr.add_request("a", list(range(8)))  # 2 SWA blocks
    mgr.add_request("b", list(range(100, 108)))  # 2 SWA blocks: the SWA pool is full
    before = snapshot(mgr)
    # 'a' would release block 0 (out of window) but needs 2 new blocks: only 1 would be free.
    with pytest.raises(CacheFullError):
        mgr.append_tokens("a", list(range(5)))
    assert snapshot(mgr) == before
    mgr.check_invariants()
    assert mgr.append_tokens("a", [1]) == 0  # one new block fits after the release
    assert mgr.block_ids("a", 1)[0] is None
    mgr.check_invariants()


def test_eviction_never_touches_running_requests() -> None:
    mgr = make(spec(8), metadata_only=True)
    mgr.add_request("keep", list(range(12)))  # 3 blocks held
    kept = mgr.block_ids("keep", 0)
    for i in range(20):
        rid = f"r{i}"
        mgr.add_request(rid, list(range(1000 * i, 1000 * i + 17)))  # 5 blocks
        mgr.free_request(rid)
        assert mgr.block_ids("keep", 0) == kept
        mgr.check_invariants()
    with pytest.raises(CacheFullError):
        mgr.add_request("huge", list(range(5000, 5030)))  # 8 blocks > 5 free
    assert mgr.block_ids("keep", 0) == kept


# ---------------------------------------------------------------------- K/V


def test_kv_round_trip_and_reused_prefix_returns_identical_bytes() -> None:
    mgr = make(spec(32, layers=3))
    prompt = list(range(1, 15))  # 14 tokens
    mgr.add_request("a", prompt)
    written = {layer: kv(14, seed=layer) for layer in range(3)}
    for layer, (k, v) in written.items():
        mgr.write_kv("a", layer, k, v)
    for layer, (k, v) in written.items():
        k2, v2 = mgr.read_kv("a", layer)
        assert torch.equal(k2, k)
        assert torch.equal(v2, v)
        k3, v3 = mgr.read_kv("a", layer, start=3, end=9)
        assert torch.equal(k3, k[3:9])
        assert torch.equal(v3, v[3:9])
    mgr.free_request("a")

    m = mgr.add_request("b", [*prompt[:12], 77, 78])
    boundary = m.groups[0].matched_tokens
    assert boundary == 12
    for layer, (k, v) in written.items():
        kb, vb = mgr.read_kv("b", layer, end=boundary)
        assert kb.numpy().tobytes() == k[:12].numpy().tobytes()
        assert vb.numpy().tobytes() == v[:12].numpy().tobytes()
        with pytest.raises(KVAccessError, match="read-only"):
            mgr.write_kv("b", layer, *kv(2, 9), start=10)
        k_new, v_new = kv(2, seed=100 + layer)
        mgr.write_kv("b", layer, k_new, v_new, start=boundary)
        kb, _ = mgr.read_kv("b", layer)
        assert torch.equal(kb[:12], k[:12])
        assert torch.equal(kb[12:], k_new)


def test_kv_in_swa_group_and_bad_access() -> None:
    mgr = make(spec(16, layers=1), spec(16, window=4, layers=1))
    mgr.add_request("a", list(range(8)))
    k, v = kv(8, 1, torch.float32)
    mgr.write_kv("a", 1, k, v)  # layer 1 is group 1's only layer
    mgr.append_tokens("a", [1, 2, 3, 4])  # next token at 8 needs [4, 8): block 0 released
    k2, _ = mgr.read_kv("a", 1)
    assert k2.shape == (8, HEADS, DIM)  # positions 4..11
    assert torch.equal(k2[:4], k[4:8].half())
    with pytest.raises(KVAccessError, match="released"):
        mgr.read_kv("a", 1, start=0)
    with pytest.raises(KVAccessError, match="layer"):
        mgr.read_kv("a", 2)
    with pytest.raises(KVAccessError, match="outside"):
        mgr.write_kv("a", 0, *kv(3, 1), start=10)
    with pytest.raises(KVAccessError, match=r"\[n, 2, 8\]"):
        mgr.write_kv("a", 0, torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), start=8)
    empty_k, empty_v = mgr.read_kv("a", 0, start=5, end=5)
    assert empty_k.shape == (0, HEADS, DIM) == empty_v.shape


def test_metadata_only_has_no_tensors() -> None:
    mgr = make(spec(8), metadata_only=True)
    mgr.add_request("a", [1, 2, 3])
    assert mgr.kv_tensor(0) is None
    assert mgr.device is None
    with pytest.raises(KVAccessError, match="metadata-only"):
        mgr.read_kv("a", 0)
    with pytest.raises(KVAccessError, match="metadata-only"):
        mgr.write_kv("a", 0, *kv(1, 0))


def test_storage_layout_and_dtype() -> None:
    mgr = make(spec(5, layers=3, dtype="bfloat16"))
    t = mgr.kv_tensor(0)
    assert t is not None
    assert t.shape == (5, 3, 2, T, HEADS, DIM)
    assert t.dtype == torch.bfloat16
    assert t.device.type == "cpu"
    mgr.add_request("a", list(range(6)))
    k, v = kv(6, 3, torch.float32)
    mgr.write_kv("a", 2, k, v)
    blk = mgr.block_ids("a", 0)[1]
    assert blk is not None
    assert torch.equal(t[blk, 2, 0, :2], k[4:6].to(torch.bfloat16))
    assert torch.equal(t[blk, 2, 1, :2], v[4:6].to(torch.bfloat16))


# ---------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
def test_gpu_auto_device_and_kv_round_trip() -> None:
    mgr = make(spec(32, layers=2), spec(16, window=8, layers=1), device="auto")
    t0 = mgr.kv_tensor(0)
    assert t0 is not None
    assert t0.device.type == "cuda"
    prompt = list(range(1, 23))
    mgr.add_request("a", prompt)
    written = {layer: kv(22, seed=layer) for layer in range(3)}
    for layer, (k, v) in written.items():
        mgr.write_kv("a", layer, k.cuda(), v.cuda())
    for layer, (k, v) in written.items():
        k2, v2 = mgr.read_kv("a", layer)
        assert k2.device.type == "cuda"
        assert torch.equal(k2.cpu(), k)
        assert torch.equal(v2.cpu(), v)
    mgr.free_request("a")
    m = mgr.add_request("b", prompt)
    assert m.groups[0].matched_tokens == 20
    kb, vb = mgr.read_kv("b", 0, end=20)
    assert kb.cpu().numpy().tobytes() == written[0][0][:20].numpy().tobytes()
    assert vb.cpu().numpy().tobytes() == written[0][1][:20].numpy().tobytes()
    mgr.check_invariants()


@pytest.mark.gpu
@needs_cuda
def test_gpu_large_pool_allocates_on_device() -> None:
    mgr = make(spec(4096, layers=4), device="cuda")
    t = mgr.kv_tensor(0)
    assert t is not None
    assert t.is_cuda
    assert t.shape[0] == 4096
    for i in range(64):
        mgr.add_request(f"r{i}", list(range(i * 100, i * 100 + 61)))
        k, v = kv(61, i)
        mgr.write_kv(f"r{i}", 3, k.cuda(), v.cuda())
        k2, _ = mgr.read_kv(f"r{i}", 3)
        assert torch.equal(k2.cpu(), k)
    mgr.check_invariants()

"""KV transfer between managers (disaggregated prefill -> decode): per-group skipping of the
receiver's own prefix, bit-identical K/V, exact stored events, framing, and refusals."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_model import assert_kv, expected_kv, prefill

from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec, RequestError
from kvstream.cache.errors import KVAccessError, TransferError
from kvstream.cache.tier_config import HostTierConfig
from kvstream.cache.transfer import KVTransfer, TokenRange, transfer_request
from kvstream.clock import ManualClock
from kvstream.events import SourceId

TPB = 4
SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4}


def make(
    windows: tuple[int | None, ...] = (None,),
    blocks: tuple[int, ...] = (32,),
    *,
    hash_algo: str = "blake3_64",
    host: int = 0,
    name: str = "m",
) -> KVCacheManager:
    cfg = CacheConfig(
        tokens_per_block=TPB,
        groups=[
            LayerGroupSpec(num_blocks=b, window_size=w, **SPEC)
            for w, b in zip(windows, blocks, strict=True)
        ],
        hash_algo=hash_algo,
        host_tier=HostTierConfig(blocks=[host] * len(windows)) if host else None,
    )
    return KVCacheManager(cfg, source=SourceId(instance_id=name), clock=ManualClock())


def stored(mgr: KVCacheManager) -> dict[int, list[bytes]]:
    """Hashes announced by the flushed stored events, per group (evictions' removals and the
    created events are not counted)."""
    out: dict[int, list[bytes]] = {}
    batch = mgr.flush_events()
    for e in [] if batch is None else batch.events:
        if e.data.type == "stored":
            out.setdefault(e.layer_group_id, []).extend(b.block_hash for b in e.data.blocks)
        else:
            assert e.data.type in ("created", "removed"), e.data
    return out


def seq(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def test_transfer_to_an_empty_receiver_sends_everything() -> None:
    src, dst = make(name="prefill"), make(name="decode")
    tokens = seq(22)
    prefill(src, "r", tokens)
    stored(dst)
    result = transfer_request(src, dst, "r")
    assert result.received_blocks == (6,)
    assert result.received_bytes == 6 * src.config.groups[0].block_bytes(TPB)
    assert_kv(dst, "r", tokens)
    assert stored(dst) == {0: src.block_hashes("r")}
    assert dst.num_tokens("r") == 22
    dst.check_invariants()
    # The request continues on the receiver like any other.
    dst.append_tokens("r", [5, 6])
    k, v = expected_kv([*tokens, 5, 6], 0, 2, 4, 22)
    dst.write_kv("r", 0, k, v, start=22)


def test_receiver_skips_the_prefix_it_holds_and_stores_only_new_blocks() -> None:
    src, dst = make(name="prefill"), make(name="decode")
    tokens = seq(22)
    prefill(dst, "earlier", tokens[:13])  # 3 full blocks cached on the receiver
    dst.free_request("earlier")
    stored(dst)
    prefill(src, "r", tokens)
    ticket = dst.begin_import("r", tokens)
    assert ticket.ranges == {0: TokenRange(12, 22)}
    transfer = src.export_kv("r", ranges=ticket.ranges)
    (g,) = transfer.groups
    assert (g.first_block, g.num_blocks, g.tokens) == (3, 3, TokenRange(12, 22))
    assert g.block_hashes[-1] is None  # block 5 holds 2 of 4 tokens
    result = dst.finish_import("r", transfer)
    assert result.received_blocks == (3,)
    assert stored(dst) == {0: src.block_hashes("r")[3:]}
    assert_kv(dst, "r", tokens)
    dst.check_invariants()


def test_a_short_sliding_window_does_not_force_resending_full_attention_groups() -> None:
    # Group 0 full attention (large pool), group 1 an 8-token window (small pool).
    src = make((None, 8), (32, 32), name="prefill")
    dst = make((None, 8), (32, 6), name="decode")
    tokens = seq(26)
    prefill(dst, "p", tokens[:20])
    dst.free_request("p")
    prefill(dst, "q", seq(21, seed=9))  # evicts p's blocks from the small window pool only
    dst.free_request("q")
    assert dst.match_prefix(tokens).groups[0].matched_tokens == 20
    dst.flush_events()
    prefill(src, "r", tokens)
    ticket = dst.begin_import("r", tokens)
    # Full attention lacks only block 5 onwards; the window of position 26 starts at block 4.
    assert ticket.ranges == {0: TokenRange(20, 26), 1: TokenRange(16, 26)}
    transfer = src.export_kv("r", ranges=ticket.ranges)
    assert [(g.layer_group_id, g.first_block, g.num_blocks) for g in transfer.groups] == [
        (0, 5, 2),
        (1, 4, 3),
    ]
    result = dst.finish_import("r", transfer)
    assert result.received_blocks == (2, 3)
    h = src.block_hashes("r")
    assert stored(dst) == {0: [h[5]], 1: h[4:6]}
    assert_kv(dst, "r", tokens)
    assert dst.block_ids("r", 1)[:4] == [None] * 4  # outside the window: never held
    dst.check_invariants()


def test_whole_export_of_a_windowed_request_carries_only_the_window() -> None:
    src = make((None, 8), (32, 32))
    tokens = seq(30)
    prefill(src, "r", tokens)
    src.append_tokens("r", [1])  # the window group releases what the next token can't see
    for layer in range(4):
        k, v = expected_kv([*tokens, 1], layer, 2, 4, 30)
        src.write_kv("r", layer, k, v, start=30)
    t = src.export_kv("r", 0, 31)
    assert [(g.first_block, g.num_blocks) for g in t.groups] == [(0, 8), (5, 3)]
    dst = make((None, 8), (32, 32))
    dst.import_kv("r", t)
    assert_kv(dst, "r", [*tokens, 1])


def test_import_onboards_receiver_blocks_from_its_host_tier() -> None:
    src, dst = make(name="prefill"), make(blocks=(6,), host=8, name="decode")
    tokens = seq(17)
    prefill(dst, "earlier", tokens)
    dst.free_request("earlier")
    prefill(dst, "other", seq(21, seed=3))  # pushes the earlier blocks to the host
    dst.free_request("other")
    prefill(src, "r", tokens)
    ticket = dst.begin_import("r", tokens)
    assert ticket.match.groups[0].onboarded_blocks == 4
    assert ticket.ranges == {0: TokenRange(16, 17)}
    dst.finish_import("r", src.export_kv("r", ranges=ticket.ranges))
    assert_kv(dst, "r", tokens)
    dst.check_invariants()


def test_multimodal_blocks_are_skipped_only_for_the_same_image() -> None:
    src, dst = make(name="prefill"), make(name="decode")
    prompt = [9] * 8 + [1, 2, 3]
    cat, dog = b"a cat", b"a dog"
    prefill(dst, "cached", prompt, mm_items=[(cat, 0, 8)])
    dst.free_request("cached")
    prefill(src, "dog", prompt, mm_items=[(dog, 0, 8)])
    prefill(src, "cat", prompt, mm_items=[(cat, 0, 8)])
    assert transfer_request(src, dst, "dog").received_blocks == (3,)
    assert transfer_request(src, dst, "cat").received_blocks == (1,)
    mm_dst = dst.block_hashes("dog")
    assert mm_dst == src.block_hashes("dog") != src.block_hashes("cat")


def test_framed_transfer_round_trips_and_crosses_processes(tmp_path: Path) -> None:
    src = make((None, 8), (32, 32))
    tokens = seq(19)
    prefill(src, "r", tokens, lora_id=3, cache_salt="tenant")
    frame = src.export_kv("r").to_bytes()
    back = KVTransfer.from_bytes(frame)
    assert back.token_ids == bytes(src.export_kv("r").token_ids)
    assert (back.lora_id, back.cache_salt) == (3, "tenant")
    # Another process imports the frame and checks the K/V it ends with.
    path = tmp_path / "r.kvtx"
    path.write_bytes(frame)
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from kv_model import assert_kv
        from test_cache_transfer import make, seq
        from kvstream.cache.transfer import KVTransfer
        dst = make((None, 8), (32, 32))
        t = KVTransfer.from_bytes(open({str(path)!r}, "rb").read())
        res = dst.import_kv("r", t)
        assert_kv(dst, "r", seq(19))
        print(res.received_blocks)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(5, 3)"


def test_corrupt_frames_raise_transfer_error_only() -> None:
    src = make()
    prefill(src, "r", seq(9))
    frame = src.export_kv("r").to_bytes()
    rng = random.Random(1)
    for _ in range(200):
        data = bytearray(frame)
        if rng.random() < 0.5:
            data = data[: rng.randrange(len(data))]
        else:
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        with pytest.raises(TransferError):
            KVTransfer.from_bytes(bytes(data))


def _unchanged(mgr: KVCacheManager) -> Any:
    return (mgr.request_ids(), mgr.cached_hashes(0), mgr.stats())


def test_refusals_leave_the_receiver_as_it_was() -> None:
    src, dst = make(), make()
    tokens = seq(14)
    prefill(src, "r", tokens)
    transfer = src.export_kv("r")
    other_layout = make(hash_algo="blake3")
    before = _unchanged(other_layout)
    with pytest.raises(TransferError, match="layout"):
        other_layout.import_kv("r", transfer)
    assert _unchanged(other_layout) == before

    ticket = dst.begin_import("r", [*tokens[:-1], tokens[-1] + 1])
    with pytest.raises(TransferError, match="tokens"):
        dst.finish_import("r", transfer)
    dst.abort_import("r")

    ticket = dst.begin_import("r", tokens)
    late = src.export_kv("r", ranges={0: TokenRange(8, 14)})
    with pytest.raises(TransferError, match=r"blocks \[2, 4\) but blocks \[0, 4\)"):
        dst.finish_import("r", late)
    with pytest.raises(RequestError, match="importing"):
        dst.append_tokens("r", [1])
    with pytest.raises(KVAccessError, match="importing"):
        dst.write_kv("r", 0, torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), start=13)
    with pytest.raises(TransferError, match="importing"):
        dst.export_kv("r")
    dst.finish_import("r", src.export_kv("r", ranges=ticket.ranges))  # still importable
    with pytest.raises(RequestError, match="not importing"):
        dst.finish_import("r", transfer)
    assert_kv(dst, "r", tokens)

    two = make((None, 8), (32, 32))
    prefill(two, "r", tokens)
    with pytest.raises(TransferError, match="different positions"):
        two.export_kv("r", ranges={0: TokenRange(0, 4), 1: TokenRange(0, 8)})
    with pytest.raises(TransferError, match="has 14 tokens"):
        src.export_kv("r", 0, 15)
    with pytest.raises(TransferError, match="valid range"):
        TokenRange(5, 4)


def test_a_failed_one_shot_import_is_aborted() -> None:
    src, dst = make(), make()
    tokens = seq(14)
    prefill(src, "r", tokens)
    partial = src.export_kv("r", 8, 14)
    with pytest.raises(TransferError):
        dst.import_kv("r", partial)
    assert "r" not in dst
    dst.check_invariants()


def test_released_window_positions_cannot_be_exported() -> None:
    src = make((None, 8), (32, 32))
    prefill(src, "r", seq(30))
    src.append_tokens("r", [1])
    with pytest.raises(TransferError, match="left layer group 1's sliding window"):
        src.export_kv("r", 0, 20)

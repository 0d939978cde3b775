"""Tiers and transfer with the GPU pool on CUDA: pinned host memory, asynchronous copies,
disk round trips through staging, and transfers between CUDA and CPU managers.

Skipped without CUDA; run them on a GPU machine (``pytest -m gpu``). The CPU tests of
tests/test_cache_tiers.py and tests/test_cache_transfer.py also run on CUDA there (their
managers use ``device="auto"``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kv_model import assert_kv, prefill

from kvstream.cache import (
    CacheConfig,
    DiskTierConfig,
    HostTierConfig,
    KVCacheManager,
    LayerGroupSpec,
    transfer_request,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TPB = 16
SPEC = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64}


def make(
    device: str,
    gpu: int,
    host: int,
    disk: Path | None = None,
    windows: tuple[int | None, ...] = (None,),
) -> KVCacheManager:
    groups = [LayerGroupSpec(num_blocks=gpu, window_size=w, **SPEC) for w in windows]
    return KVCacheManager(
        CacheConfig(
            tokens_per_block=TPB,
            groups=groups,
            device=device,
            host_tier=HostTierConfig(blocks=[host] * len(groups)) if host else None,
            disk_tier=None if disk is None else DiskTierConfig(disk, capacity_bytes=1 << 30),
        )
    )


def test_host_tier_is_pinned_and_round_trips_bit_identical(tmp_path: Path) -> None:
    mgr = make("cuda", gpu=8, host=4, disk=tmp_path)
    host = mgr._tiers._host  # type: ignore[union-attr]
    assert host is not None
    assert host.tensors[0].is_pinned()
    tokens = list(range(1, 16 * 7 + 2))  # 7 full blocks
    prefill(mgr, "a", tokens)
    mgr.free_request("a")
    prefill(mgr, "b", list(range(5000, 5000 + 16 * 8)))  # all of a's blocks go down
    mgr.free_request("b")
    tier = mgr.stats().groups[0].tier
    assert tier is not None
    assert tier.offloaded_to_disk >= 3
    match = mgr.add_request("a2", tokens)
    assert match.groups[0].onboarded_blocks == 7
    assert_kv(mgr, "a2", tokens[: 7 * TPB])
    mgr.check_invariants()
    mgr.close()


def test_transfer_between_cuda_and_cpu_managers() -> None:
    src = make("cuda", gpu=64, host=0, windows=(None, 32))
    dst = make("cpu", gpu=64, host=0, windows=(None, 32))
    tokens = list(range(7, 7 + 200))
    prefill(src, "r", tokens)
    prefill(dst, "warm", tokens[:100])
    dst.free_request("warm")
    result = transfer_request(src, dst, "r")
    # 13 blocks; the receiver holds 6 in the full group, and the window of position 200
    # needs only blocks 10.. of the sliding one.
    assert result.received_blocks == (7, 3)
    assert_kv(dst, "r", tokens)
    back = make("cuda", gpu=64, host=0, windows=(None, 32))
    transfer_request(dst, back, "r")
    assert_kv(back, "r", tokens)

"""The replay's fast paths change nothing it reports: the cache's whole-request hashing, the
emitter's batches built without re-validation and the replay's garbage-collector thresholds,
each against the reference path it replaces."""

from __future__ import annotations

import asyncio
import gc
import random
from typing import Any

import pytest

from kvstream._types import TokenIds
from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec
from kvstream.cache.manager import KVCacheManager as Manager
from kvstream.cli import replay_run
from kvstream.cli.replay_run import ReplayOptions, ReplayResult, run_replay
from kvstream.events import emitter
from kvstream.events.deferred import model_input
from kvstream.events.model import EventBatch, SourceId
from kvstream.hashing import available_hashers, get_hasher
from kvstream.hashing.base import ChainState


def fold_extend(self: Any, chain: ChainState, raw: bytes, first: int, items: Any) -> Any:
    """The reference: one ``extend`` per full block."""
    step = 4 * self._tpb
    out = []
    for j in range(len(raw) // step):
        h, chain = self._hasher.extend(chain, TokenIds.from_bytes(raw[j * step : (j + 1) * step]))
        out.append(h)
    return out, chain


def validated(source: SourceId, ts_ns: int, records: Any) -> EventBatch:
    return EventBatch(source=source, ts_ns=ts_ns, events=model_input(records))


@pytest.mark.parametrize("algo", sorted(available_hashers()))
def test_cache_hashes_equal_one_extend_per_block(algo: str) -> None:
    try:
        get_hasher(algo)
    except Exception:  # an algorithm that needs parameters
        pytest.skip(f"{algo} needs parameters")
    tpb = 4
    cfg = CacheConfig(
        tokens_per_block=tpb,
        groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=64)],
        hash_algo=algo,
        metadata_only=True,
    )
    rng = random.Random(algo)
    fast = KVCacheManager(cfg, source=SourceId(instance_id="a"))
    ref = KVCacheManager(cfg, source=SourceId(instance_id="b"))
    ref._hash_blocks = fold_extend.__get__(ref)  # type: ignore[method-assign]
    for i in range(12):
        prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        output = [rng.randrange(50) for _ in range(rng.randrange(0, 11))]
        for m in (fast, ref):
            m.add_request(f"r{i}", prompt)
            if output:
                m.append_tokens(f"r{i}", output)
        assert fast.block_hashes(f"r{i}") == ref.block_hashes(f"r{i}")
        for m in (fast, ref):
            m.free_request(f"r{i}")


def comparable(r: ReplayResult) -> dict[str, Any]:
    d = r.as_dict()
    for k in ("wall_s", "requests_per_s"):
        d.pop(k)
    d["per_request"] = list(r.per_request)  # every request: worker, queue wait, TTFT, hits
    d["timeline"] = list(r.timeline)
    d["ttft"] = list(r.ttft_s)
    return d


@pytest.mark.parametrize("router", ["kv", "round-robin"])
def test_replay_results_equal_the_reference_paths(
    router: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = ReplayOptions(trace="conversation", limit=1000, router=router)
    fast = asyncio.run(run_replay(opts))
    monkeypatch.setattr(Manager, "_hash_blocks", fold_extend)
    monkeypatch.setattr(emitter, "emitted_batch", validated)
    monkeypatch.setattr(replay_run, "_REPLAY_GC_THRESHOLDS", gc.get_threshold())
    ref = asyncio.run(run_replay(opts))
    assert fast.requests == 1000
    assert fast.prediction_accuracy == 1.0
    assert comparable(fast) == comparable(ref)


def test_gc_thresholds_are_restored() -> None:
    before = gc.get_threshold()
    asyncio.run(run_replay(ReplayOptions(trace="conversation", limit=5)))
    assert gc.get_threshold() == before

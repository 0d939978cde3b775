"""The adaptive ``kv`` router: its cost, the signals it learns from, and the load tracker's
pending prefill."""

from __future__ import annotations

import pytest
from index_support import Producer, tokens

from kvstream.index import LoadTracker, PrefixIndex, Router, RouterConfig, WorkerKey
from kvstream.index.router import MAX_UTILISATION, UTILISATION_HORIZON

A, B, C = WorkerKey("a"), WorkerKey("b"), WorkerKey("c")
PROMPT = tokens(41)  # 10 full blocks of 4 tokens, and one more token


def setup(cached: dict[str, int]) -> PrefixIndex:
    idx = PrefixIndex()
    for name in ("a", "b", "c"):
        p = Producer(name)
        evs = [p.created()]
        if cached.get(name):
            evs.append(p.stored(p.chain(PROMPT)[: cached[name]]))
        idx.apply(p.batch(*evs))
    return idx


def test_load_tracker_counts_pending_prefill_until_the_first_token() -> None:
    load = LoadTracker()
    load.start("r1", A, 10, prefill_blocks=6.5)
    load.start("r2", A, 4)  # default: all its blocks still to prefill
    load.start("r3", B, 3, prefill_blocks=0)
    assert load.pending_prefill_blocks(A) == pytest.approx(10.5)
    assert load.pending_prefill_blocks(B) == 0.0
    assert load.load(A).pending_prefill_blocks == pytest.approx(10.5)
    load.prefilled("r1")
    load.prefilled("r1")  # idempotent
    assert load.pending_prefill_blocks(A) == pytest.approx(4.0)
    assert load.active_blocks(A) == 14  # still holding its blocks while it decodes
    load.finish("r2")  # finishing also ends its prefill
    assert load.pending_prefill_blocks(A) == 0.0
    load.finish("r1")
    assert (load.active_requests(A), load.active_blocks(A)) == (0, 0)
    load.prefilled("unknown")


def test_adaptive_cost_is_weighted_prefill_plus_queued_prefill() -> None:
    idx = setup({"a": 2, "b": 7})
    load = LoadTracker()
    router = Router(idx, [A, B, C], load=load)
    assert router.config.overlap_weight is None
    assert router.affinity_weight == pytest.approx(2.0)  # prior: each block reused once
    load.start("r1", B, 20, prefill_blocks=12.0)  # b has 12 blocks of prefill queued
    d = router.route(PROMPT)
    u = 1 / 3 / UTILISATION_HORIZON  # one of three workers had pending prefill
    w = 2.0 / (1 - u)
    by = {str(s.worker): s for s in d.scores}
    assert d.affinity_weight == pytest.approx(w)
    assert by["a/-"].cost == pytest.approx(w * (41 - 8) / 4)
    assert by["b/-"].cost == pytest.approx(w * (41 - 28) / 4 + 12.0)
    assert by["b/-"].pending_prefill_blocks == 12.0
    assert d.worker == A  # b's queue costs more than the prefill it saves
    assert by["a/-"].as_dict()["pending_prefill_blocks"] == 0.0
    load.prefilled("r1")
    assert router.route(PROMPT).worker == B  # queue gone: affinity wins


def test_weight_learns_reuse_and_utilisation() -> None:
    idx = setup({"b": 10})
    load = LoadTracker()
    router = Router(idx, [A, B, C], load=load)
    for i, w in enumerate((A, B, C)):
        load.start(f"q{i}", w, 1, prefill_blocks=1.0)  # every worker busy prefilling
    for _ in range(3 * UTILISATION_HORIZON):
        router.route(PROMPT)  # b holds all 10 blocks: reuse observed, no prefill
    s = router.signals
    assert s["utilisation"] > 0.9
    assert s["reuse"] > 5.0
    u = min(s["utilisation"], MAX_UTILISATION)
    assert router.affinity_weight == pytest.approx((1 + s["reuse"]) / (1 - u))
    # a busy fleet with high reuse keeps affinity even against a long queue on b
    load.start("big", B, 100, prefill_blocks=60.0)
    assert router.route(PROMPT).worker == B


def test_fixed_weight_keeps_dynamos_cost() -> None:
    idx = setup({"b": 7})
    load = LoadTracker()
    load.start("r1", B, 5, prefill_blocks=100.0)  # pending prefill is not in the fixed cost
    d = Router(idx, [A, B, C], RouterConfig(overlap_weight=1.0), load=load).route(PROMPT)
    by = {str(s.worker): s for s in d.scores}
    assert by["b/-"].cost == pytest.approx((41 - 28) / 4 + 5)
    assert d.affinity_weight == 1.0
    baseline = Router(idx, [A, B, C], RouterConfig(policy="round-robin")).route(PROMPT)
    assert baseline.affinity_weight is None
    assert "affinity_weight" in d.as_dict()

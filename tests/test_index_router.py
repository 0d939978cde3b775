"""Router scoring: Dynamo-style cost, tier weights, stale workers, ties, baselines, config."""

from __future__ import annotations

import pytest
from index_support import Producer, tokens

from kvstream.errors import ConfigError
from kvstream.index import (
    HashConfigMismatchError,
    LoadTracker,
    PrefixIndex,
    Router,
    RouterConfig,
    RoutingPolicy,
    WorkerKey,
)

A, B, C = WorkerKey("a"), WorkerKey("b"), WorkerKey("c")
PROMPT = tokens(8, seed=1) + tokens(33, seed=2)  # 41 tokens: 10 full blocks of tokens[:-1]


def setup(cached: dict[str, int], level: int = 0) -> tuple[PrefixIndex, dict[str, Producer]]:
    """Workers a, b, c; each holds the first ``cached[name]`` blocks of PROMPT."""
    idx = PrefixIndex()
    ps = {}
    for name in ("a", "b", "c"):
        p = ps[name] = Producer(name)
        evs = [p.created()]
        n = cached.get(name, 0)
        if n:
            evs.append(p.stored(p.chain(PROMPT)[:n], level=level))
        idx.apply(p.batch(*evs))
    return idx, ps


def test_kv_prefers_the_longest_prefix_at_equal_load() -> None:
    idx, _ = setup({"a": 2, "b": 7, "c": 4})
    router = Router(idx, [A, B, C])
    d = router.route(PROMPT)
    assert d.worker == B
    assert d.policy is RoutingPolicy.KV
    assert [s.match.matched_blocks for s in d.scores] == [2, 7, 4]
    assert d.predicted_blocks == 7
    chosen = d.chosen
    assert chosen is not None
    assert chosen.prefill_blocks == pytest.approx((41 - 28) / 4)


def test_cost_trades_prefill_against_active_load() -> None:
    idx, _ = setup({"a": 2, "b": 7})
    load = LoadTracker()
    router = Router(idx, [A, B, C], RouterConfig(overlap_weight=1.0), load=load)
    load.start("r1", B, 5)
    # a: prefill (41-8)/4 = 8.25, load 0 -> 8.25; b: (41-28)/4 = 3.25 + 5 = 8.25; c: 10.25
    d = router.route(PROMPT)
    costs = {str(s.worker): s.cost for s in d.scores}
    assert costs == {
        "a/-": pytest.approx(8.25),
        "b/-": pytest.approx(8.25),
        "c/-": pytest.approx(10.25),
    }
    assert d.worker == A  # equal cost: the less loaded one
    load.start("r2", B, 1)
    assert router.route(PROMPT).worker == A
    load.finish("r1")
    load.finish("r2")
    assert router.route(PROMPT).worker == B
    heavy = Router(idx, [A, B, C], RouterConfig(overlap_weight=10.0), load=load)
    load.start("r3", B, 40)  # affinity worth 10 * 5 blocks = 50 > 40
    assert heavy.route(PROMPT).worker == B


def test_lower_tiers_count_less() -> None:
    idx, ps = setup({"a": 6})
    p = ps["b"]
    idx.apply(p.batch(p.stored(p.chain(PROMPT)[:7], level=2)))  # on disk
    d = Router(idx, [A, B]).route(PROMPT)
    by = {s.worker: s for s in d.scores}
    assert by[B].match.matched_blocks == 7
    assert by[B].match.weighted_blocks == pytest.approx(3.5)
    assert d.worker == A
    cfg = RouterConfig(tier_weights=(1.0, 1.0, 1.0))
    assert Router(idx, [A, B], cfg).route(PROMPT).worker == B


def test_stale_workers_count_no_overlap() -> None:
    idx, ps = setup({"a": 3, "b": 9})
    p = ps["b"]
    p.skip()
    idx.apply(p.batch(p.stored(p.chain(tokens(8, seed=9)))))
    d = Router(idx, [A, B]).route(PROMPT)
    by = {s.worker: s for s in d.scores}
    assert not by[B].match.trusted
    assert by[B].match.matched_blocks == 9
    assert d.worker == A


def test_ties_rotate_deterministically() -> None:
    idx, _ = setup({})
    router = Router(idx, [A, B, C])
    picks = [router.route(PROMPT).worker for _ in range(6)]
    assert picks == [A, B, C, A, B, C]
    again = Router(idx, [A, B, C])
    assert [again.route(PROMPT).worker for _ in range(6)] == picks


def test_baselines() -> None:
    idx, _ = setup({"b": 9})
    rr = Router(idx, [A, B, C], RouterConfig(policy="round-robin"))
    assert [rr.route(PROMPT).worker for _ in range(4)] == [A, B, C, A]
    r1 = Router(idx, [A, B, C], RouterConfig(policy="random", seed=3))
    r2 = Router(idx, [A, B, C], RouterConfig(policy="random", seed=3))
    picks = [r1.route(PROMPT).worker for _ in range(20)]
    assert picks == [r2.route(PROMPT).worker for _ in range(20)]
    assert set(picks) == {A, B, C}
    load = LoadTracker()
    ll = Router(idx, [A, B, C], RouterConfig(policy="least-loaded"), load=load)
    load.start("x", A, 3)
    load.start("y", C, 1)
    d = ll.route(PROMPT)
    assert d.worker == B
    assert {s.worker: s.match.matched_blocks for s in d.scores}[B] == 9  # still explained
    quiet = Router(idx, [A, B], RouterConfig(policy="round-robin", explain=False))
    d = quiet.route(PROMPT)
    assert d.scores == ()
    assert d.chosen is None
    assert d.predicted_blocks == 0


def test_decision_as_dict() -> None:
    idx, _ = setup({"a": 1})
    d = Router(idx).route(PROMPT)  # candidates: every worker the index knows
    out = d.as_dict()
    assert out["worker"] == "a/-"
    assert out["policy"] == "kv"
    assert out["num_tokens"] == 41
    assert [s["worker"] for s in out["scores"]] == ["a/-", "b/-", "c/-"]
    assert out["scores"][0]["matched_blocks"] == 1
    assert out["scores"][0]["hash_algo"] == "blake3_64"


def test_hashing_cannot_be_misconfigured_silently() -> None:
    idx, _ = setup({"a": 2})
    wrong = Router(idx, [A, B], RouterConfig(hash_algo="v2_sha256"))
    with pytest.raises(HashConfigMismatchError, match="blake3_64"):
        wrong.check()
    with pytest.raises(HashConfigMismatchError):
        wrong.route(PROMPT)
    with pytest.raises(HashConfigMismatchError, match="4-token"):
        Router(idx, [A], RouterConfig(tokens_per_block=16)).route(PROMPT)
    right = Router(idx, [A, B], RouterConfig(hash_algo="blake3_64", tokens_per_block=4))
    right.check()
    assert right.route(PROMPT).worker == A


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown routing policy"):
        RouterConfig(policy="fastest")
    with pytest.raises(ConfigError):
        RouterConfig(overlap_weight=-1)
    with pytest.raises(ConfigError):
        RouterConfig(tier_weights=())
    with pytest.raises(ConfigError):
        Router(PrefixIndex(), [])
    with pytest.raises(ConfigError, match="no workers"):
        Router(PrefixIndex()).route(PROMPT)


def test_load_tracker() -> None:
    t = LoadTracker()
    t.start("r", A, 4)
    t.start("s", A, 2)
    t.update("s", 5)
    assert t.load(A).active_requests == 2
    assert t.load(A).active_blocks == 9
    t.start("r", B, 1)  # moved, not double counted
    assert t.active_blocks(A) == 5
    assert t.active_blocks(B) == 1
    assert len(t) == 2
    assert t.finish("s") == A
    assert t.finish("s") is None
    t.update("nope", 3)
    assert t.load(C).active_blocks == 0

"""The router's and the index's query fast paths against their reference forms: the load
tracker's one-row-per-worker storage and its column read, the pick of the lowest cost, the
index's memoised match plan for a router's candidate tuple, and zero rows of many request
lengths."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from index_support import Producer, tokens

from kvstream.index import LoadTracker, PrefixIndex, Router, RouterConfig, WorkerKey
from kvstream.index.router import RouteDecision, RoutingPolicy, _lowest

KEYS = [WorkerKey(f"w{i}", i % 2 or None) for i in range(4)]


class _ReferenceLoad:
    """The tracker as three dicts of counters (its former form): what every read must give."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[WorkerKey, int]] = {}
        self.blocks: dict[WorkerKey, int] = {}
        self.count: dict[WorkerKey, int] = {}
        self.prefill: dict[str, float] = {}
        self.pending: dict[WorkerKey, float] = {}
        self.pending_count: dict[WorkerKey, int] = {}

    def start(self, rid: str, w: WorkerKey, blocks: int, prefill: float | None) -> None:
        self.finish(rid)
        self.requests[rid] = (w, blocks)
        self.blocks[w] = self.blocks.get(w, 0) + blocks
        self.count[w] = self.count.get(w, 0) + 1
        todo = float(blocks if prefill is None else max(prefill, 0.0))
        if todo:
            self.prefill[rid] = todo
            self.pending[w] = self.pending.get(w, 0.0) + todo
            self.pending_count[w] = self.pending_count.get(w, 0) + 1

    def prefilled(self, rid: str) -> None:
        todo = self.prefill.pop(rid, None)
        if todo is None:
            return
        w = self.requests[rid][0]
        n = self.pending_count[w] - 1
        self.pending_count[w] = n
        self.pending[w] = self.pending[w] - todo if n else 0.0

    def update(self, rid: str, blocks: int) -> None:
        cur = self.requests.get(rid)
        if cur is not None:
            self.requests[rid] = (cur[0], blocks)
            self.blocks[cur[0]] += blocks - cur[1]

    def finish(self, rid: str) -> WorkerKey | None:
        if rid not in self.requests:
            return None
        self.prefilled(rid)
        w, blocks = self.requests.pop(rid)
        self.blocks[w] -= blocks
        self.count[w] -= 1
        return w


_ops = st.lists(
    st.tuples(
        st.sampled_from(["start", "prefilled", "update", "finish"]),
        st.integers(0, 5),  # request id
        st.integers(0, len(KEYS) - 1),
        st.integers(0, 40),
        st.one_of(st.none(), st.floats(-2.0, 40.0, allow_nan=False)),
    ),
    max_size=60,
)


@given(ops=_ops)
def test_load_tracker_equals_the_reference_counters(
    ops: list[tuple[str, int, int, int, float | None]],
) -> None:
    """Any sequence of start/prefilled/update/finish: every read of the tracker (per
    worker and as columns) equals the reference's, float sums included."""
    t = LoadTracker()
    ref = _ReferenceLoad()
    for op, r, w, blocks, prefill in ops:
        rid = f"r{r}"
        if op == "start":
            t.start(rid, KEYS[w], blocks, prefill_blocks=prefill)
            ref.start(rid, KEYS[w], blocks, prefill)
        elif op == "prefilled":
            t.prefilled(rid)
            ref.prefilled(rid)
        elif op == "update":
            t.update(rid, blocks)
            ref.update(rid, blocks)
        else:
            assert t.finish(rid) == ref.finish(rid)
        assert len(t) == len(ref.requests)
        want = (
            tuple(ref.pending.get(k, 0.0) for k in KEYS),
            tuple(ref.blocks.get(k, 0) for k in KEYS),
            tuple(ref.count.get(k, 0) for k in KEYS),
        )
        assert t.columns(KEYS) == want
        for i, k in enumerate(KEYS):
            load = t.load(k)
            assert (load.pending_prefill_blocks, load.active_blocks, load.active_requests) == (
                want[0][i],
                want[1][i],
                want[2][i],
            )
            assert t.pending_prefill_blocks(k) == want[0][i]
            assert t.active_blocks(k) == want[1][i]
            assert t.active_requests(k) == want[2][i]
    assert t.columns([]) == ((), (), ())


@given(
    rows=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 2)), min_size=1, max_size=9
    ),
    start=st.integers(0, 100),
    with_costs=st.booleans(),
)
def test_lowest_equals_the_rotation_ordered_min(
    rows: list[tuple[int, int, int]], start: int, with_costs: bool
) -> None:
    """The pick equals min() over (cost, active blocks, active requests, rotation rank), ties
    (which small values make common) included."""
    n = len(rows)
    costs = [float(c) / 2 for c, _, _ in rows]
    blocks = [b for _, b, _ in rows]
    requests = [r for _, _, r in rows]
    s = start % n
    if with_costs:
        want = min(range(n), key=lambda j: (costs[j], blocks[j], requests[j], (j - s) % n))
    else:
        want = min(range(n), key=lambda j: (blocks[j], requests[j], (j - s) % n))
    assert _lowest(costs if with_costs else None, blocks, requests, s) == want


def _producers(n: int) -> list[Producer]:
    return [Producer(k.instance_id, rank=k.dp_rank) for k in KEYS[:n]]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_memoised_plan_of_a_router_follows_every_index_change(seed: int) -> None:
    """A router hands the index the same candidate tuple call after call (the index then
    reuses its plan without rebuilding the key): its matches equal the index's answer to a
    fresh list of the same candidates after stores, new workers, stale marks, resyncs,
    forgets and workers coming back."""
    rng = random.Random(seed)
    idx = PrefixIndex()
    producers = _producers(len(KEYS))
    prompts = [tokens(4 * rng.randint(1, 6) + 1, seed=s) for s in range(3)]
    router = Router(idx, KEYS, RouterConfig(hash_algo="blake3_64", tokens_per_block=4))
    started: set[int] = set()
    for step in range(30):
        w = rng.randrange(len(KEYS))
        p = producers[w]
        action = rng.randrange(6)
        if w not in started or action == 5:
            if w in started:
                idx.forget(KEYS[w])
                p.restart(p.source.incarnation + 1)
            started.add(w)
            idx.apply(p.batch(p.created()))
        elif action < 3:
            chain = p.chain(rng.choice(prompts)[:-1])
            idx.apply(p.batch(p.stored(chain[: rng.randint(1, len(chain))])))
        elif action == 3:
            idx.mark_stale(KEYS[w], "test")
        else:
            idx.resync(KEYS[w], purge=rng.random() < 0.5)
        for prompt in prompts:
            got = router.match(prompt)
            want = idx.match(prompt, workers=list(KEYS), hash_algo="blake3_64", tokens_per_block=4)
            assert got == want, step
            assert router.match(prompt) == got  # the memo's second use


def test_zero_rows_of_many_request_lengths_equal_a_fresh_index() -> None:
    """More distinct request lengths than a plan kept zero rows for before: every match
    equals the same index's answer through an uncached plan."""
    producers = _producers(2)
    idx = PrefixIndex()
    for p in producers:
        idx.apply(p.batch(p.created(), p.stored(p.chain(tokens(41, seed=1)[:-1])[:3])))
    cands = tuple(KEYS[:2])
    for n in [*range(1, 400, 3), *range(400, 1, -7)]:
        prompt = tokens(n, seed=n % 3)
        got = idx.match(prompt, workers=cands)
        idx._plans.clear()  # a plan built anew: no zero rows
        assert got == idx.match(prompt, workers=list(cands))
        assert got.matches[0].request_blocks == (n - 1) // 4


def test_decisions_are_the_dataclass_instances() -> None:
    """The decision built by the C constructor is a RouteDecision equal to the one its
    generated __init__ builds, frozen and slotted."""
    producers = _producers(3)
    idx = PrefixIndex()
    for p in producers:
        idx.apply(p.batch(p.created()))
    prompt = tokens(21)
    for policy in ("kv", "least-loaded", "round-robin"):
        d = Router(idx, KEYS[:3], RouterConfig(policy=policy)).route(prompt)
        assert type(d) is RouteDecision
        assert d == RouteDecision(
            d.worker, RoutingPolicy(policy), d.num_tokens, d.scores, d.affinity_weight
        )
        assert d.chosen is not None
        assert d.chosen.worker == d.worker
        assert not hasattr(d, "__dict__")

"""A KV-aware router over a :class:`~kvstream.index.index.PrefixIndex`, and baselines.

::

    router = Router(index, workers)             # the adaptive kv policy: nothing to tune
    decision = router.route(tokens)             # RouteDecision: worker + per-worker scores
    router.load.start(request_id, decision.worker, blocks,
                      prefill_blocks=decision.chosen.prefill_blocks)
    router.load.prefilled(request_id)           # first token out
    router.load.finish(request_id)

Policies:

- ``kv`` (the default), for each worker: ``prefill_blocks`` = the request's blocks minus the
  tier-weighted cached prefix the worker holds (GPU 1.0, host 0.8, disk 0.5 by default; a
  stale worker counts none). The lowest cost wins:

  - **adaptive** (``overlap_weight=None``, the default): ``cost = w * prefill_blocks +
    pending_prefill_blocks``, where ``pending_prefill_blocks`` is the prefill the worker still
    has to do for requests already sent to it (what this request would queue behind: both
    terms are blocks of prefill, i.e. time to first token), and the affinity weight
    ``w = (1 + m) / (1 - u)`` is learnt online from two signals the router observes itself:
    ``m``, how many times a prefilled block has been reused (cached blocks it routed to over
    blocks it had prefilled, a decaying average), the future value of keeping a prefix where
    it is; and ``u``, the fleet's prefill utilisation (the share of workers with pending
    prefill at each decision, which Poisson arrivals see as the time average), because work
    added to a queue that is busy a fraction ``u`` of the time delays later requests by
    about ``1 / (1 - u)`` times its own length. Idle fleets therefore route for the earliest
    first token, busy ones for affinity (saving prefill is then what shortens the queues).
    See docs/replay.md for the measurements.
  - **fixed** (``overlap_weight`` a number, Dynamo's cost): ``cost = overlap_weight *
    prefill_blocks + active_blocks``. Pure prefix affinity would send every request that
    shares a first block to one worker; the load term spreads them.

- ``round-robin``, ``random`` (seeded), ``least-loaded`` (fewest active blocks, then
  requests): baselines that ignore the cache.

Ties go to the worker with the least load, then rotate deterministically (the k-th decision
starts its tie order at worker k mod N), so equal workers share the work and runs repeat.

Hashing is never configured by hand: the index hashes each request with the algorithm and
block size each worker advertises. ``RouterConfig.hash_algo``/``tokens_per_block``, when set,
state what the caller expects; a worker advertising anything else raises
:class:`~kvstream.index.errors.HashConfigMismatchError` instead of being silently missed.

Every policy reports the per-worker match (unless ``explain=False`` for the baselines), so a
caller can see why a worker was chosen and what the index predicted it holds.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from kvstream._native import load as load_native
from kvstream.errors import ConfigError
from kvstream.index.index import PrefixIndex
from kvstream.index.load import LoadTracker
from kvstream.index.matching import (
    HashRequest,
    MatchResult,
    WorkerMatch,
    weights_tuple,
)
from kvstream.index.record import Record
from kvstream.index.types import DEFAULT_TIER_WEIGHTS, WorkerKey

__all__ = ["RouteDecision", "Router", "RouterConfig", "RoutingPolicy", "WorkerScore"]

if TYPE_CHECKING:  # typed by its stub; None at run time when not loaded
    from kvstream.index._match_native import score as _score
else:
    _score = getattr(load_native("kvstream.index._match_native"), "score", None)

#: Decisions over which the utilisation estimate averages (an EWMA's 1/alpha).
UTILISATION_HORIZON = 100
#: Decisions over which the reuse estimate averages (a decaying sum's 1/decay).
REUSE_HORIZON = 1000
#: Utilisation is capped here (the weight then is at most 20 * (1 + m)).
MAX_UTILISATION = 0.95


class RoutingPolicy(str, enum.Enum):
    """How a worker is picked."""

    KV = "kv"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    LEAST_LOADED = "least-loaded"


@dataclass(frozen=True)
class RouterConfig:
    """Router settings; see the module docstring.

    ``overlap_weight``: None (the default) adapts the ``kv`` trade-off between prefix affinity
    and load online; a number fixes it (Dynamo's cost: weight of prefill blocks against
    active blocks; higher: more cache affinity). ``tier_weights`` per cache level;
    ``layer_group_id`` the group whose blocks are matched; ``hash_algo``/
    ``tokens_per_block`` optional expectations checked against every worker; ``seed`` for
    ``random``; ``explain`` computes the per-worker match for the baselines too.
    """

    policy: RoutingPolicy | str = RoutingPolicy.KV
    overlap_weight: float | None = None
    tier_weights: tuple[float, ...] = DEFAULT_TIER_WEIGHTS
    layer_group_id: int = 0
    hash_algo: str | None = None
    tokens_per_block: int | None = None
    seed: int = 0
    explain: bool = True

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "policy", RoutingPolicy(self.policy))
        except ValueError:
            names = ", ".join(p.value for p in RoutingPolicy)
            raise ConfigError(
                f"unknown routing policy {self.policy!r}; use one of {names}"
            ) from None
        if self.overlap_weight is not None and not 0.0 <= self.overlap_weight <= 1e6:
            raise ConfigError(f"overlap_weight must be >= 0, got {self.overlap_weight}")
        try:
            object.__setattr__(self, "tier_weights", weights_tuple(self.tier_weights))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.tokens_per_block is not None and self.tokens_per_block < 1:
            raise ConfigError(f"tokens_per_block must be >= 1, got {self.tokens_per_block}")


class WorkerScore(Record):
    """One worker's side of a decision: its match, load, and (``kv``) the cost terms
    (``pending_prefill_blocks``: prefill already queued on the worker)."""

    __slots__ = ()
    match: WorkerMatch
    active_requests: int
    active_blocks: int
    prefill_blocks: float
    cost: float
    pending_prefill_blocks: float = 0.0

    @property
    def worker(self) -> WorkerKey:
        """The worker."""
        return self.match.worker

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        d = self.match.as_dict()
        d.update(
            active_requests=self.active_requests,
            active_blocks=self.active_blocks,
            prefill_blocks=round(self.prefill_blocks, 6),
            pending_prefill_blocks=round(self.pending_prefill_blocks, 6),
            cost=round(self.cost, 6),
        )
        return d


#: the router builds one per candidate worker and decision (a record: one C call)
_new_score: Final = WorkerScore


class RouteDecision(Record):
    """The chosen worker and every candidate's score (candidate order); ``affinity_weight``
    the ``kv`` weight of prefill blocks used (None for the baselines)."""

    __slots__ = ()
    worker: WorkerKey
    policy: RoutingPolicy
    num_tokens: int
    scores: tuple[WorkerScore, ...] = ()
    affinity_weight: float | None = None

    @property
    def chosen(self) -> WorkerScore | None:
        """The chosen worker's score (None when matches were not computed)."""
        w = self.worker
        for s in self.scores:
            if s.match.worker == w:
                return s
        return None

    @property
    def predicted_blocks(self) -> int:
        """Blocks the index says the chosen worker can reuse (0 when stale or unknown)."""
        c = self.chosen
        return 0 if c is None else c.match.usable_blocks

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "worker": str(self.worker),
            "policy": self.policy.value,
            "num_tokens": self.num_tokens,
            "affinity_weight": self.affinity_weight,
            "scores": [s.as_dict() for s in self.scores],
        }


#: one per routed request
_new_decision: Final = RouteDecision


class Router:
    """Picks a worker per request; see the module docstring.

    ``workers``: the candidates (default: every worker the index knows at routing time).
    ``load``: the tracker whose active load the ``kv`` and ``least-loaded`` policies use
    (a new one by default; the caller starts and finishes requests on it).
    """

    def __init__(
        self,
        index: PrefixIndex,
        workers: Sequence[WorkerKey | tuple[str, int | None]] | None = None,
        config: RouterConfig | None = None,
        *,
        load: LoadTracker | None = None,
    ) -> None:
        self.index = index
        self.config = config or RouterConfig()
        self.load = load if load is not None else LoadTracker()
        # a tuple: the index recognises the same candidates call after call (its match plan)
        self._workers = None if workers is None else tuple(WorkerKey(w[0], w[1]) for w in workers)
        if self._workers is not None and not self._workers:
            raise ConfigError("a router needs at least one worker")
        self._rng = random.Random(self.config.seed)
        self._turn = 0
        self.decisions = 0
        # adaptive kv: decaying sums of reused and prefilled blocks (one of each as the prior:
        # a block is taken to be reused once until the router has seen otherwise), and the
        # utilisation EWMA
        self._reused = 1.0
        self._prefilled = 1.0
        self._utilisation = 0.0

    @property
    def affinity_weight(self) -> float:
        """The adaptive ``kv`` policy's current weight of prefill blocks, ``(1 + m) / (1 -
        u)`` (see the module docstring); the configured one when ``overlap_weight`` is set."""
        if self.config.overlap_weight is not None:
            return self.config.overlap_weight
        u = min(self._utilisation, MAX_UTILISATION)
        return (1.0 + self._reused / self._prefilled) / (1.0 - u)

    @property
    def signals(self) -> dict[str, float]:
        """The adaptive policy's observed signals: ``reuse`` (m), ``utilisation`` (u) and
        the resulting ``affinity_weight``."""
        return {
            "reuse": self._reused / self._prefilled,
            "utilisation": self._utilisation,
            "affinity_weight": self.affinity_weight,
        }

    @property
    def workers(self) -> list[WorkerKey]:
        """The current candidates."""
        return list(self._workers) if self._workers is not None else self.index.workers()

    def check(self) -> None:
        """Raise HashConfigMismatchError now if a worker advertises another hash algorithm
        or block size than the configured ones (routing would raise it later)."""
        self.index.match(
            [],
            layer_group_id=self.config.layer_group_id,
            workers=self.workers,
            hash_algo=self.config.hash_algo,
            tokens_per_block=self.config.tokens_per_block,
        )

    def match(
        self,
        tokens: Any,
        request: HashRequest | None = None,
        *,
        block_hashes: Sequence[bytes] | None = None,
    ) -> MatchResult:
        """Every candidate's match for ``tokens`` (what :meth:`route` scores);
        ``block_hashes`` as :meth:`PrefixIndex.match` takes them."""
        cfg = self.config
        # only when given: an index behind the router (e.g. a shard fan-out) need not know it
        extra = {} if block_hashes is None else {"block_hashes": block_hashes}
        return self.index.match(
            tokens,
            layer_group_id=cfg.layer_group_id,
            workers=self._workers if self._workers is not None else self.index.workers(),
            request=request,
            tier_weights=cfg.tier_weights,
            hash_algo=cfg.hash_algo,
            tokens_per_block=cfg.tokens_per_block,
            **extra,
        )

    def route(
        self,
        tokens: Any,
        request: HashRequest | None = None,
        *,
        block_hashes: Sequence[bytes] | None = None,
    ) -> RouteDecision:
        """Choose a worker for a request of ``tokens``; raises ConfigError without workers
        and HashConfigMismatchError for a worker hashing otherwise than configured.
        ``block_hashes``: the request's block hashes when the caller has them already (the
        configured ``hash_algo`` and ``tokens_per_block`` are then required; see
        :meth:`PrefixIndex.match`), so the request is not hashed again."""
        cfg = self.config
        policy = cfg.policy
        if type(policy) is not RoutingPolicy:
            policy = RoutingPolicy(policy)
        workers = self._workers if self._workers is not None else self.index.workers()
        if not workers:
            raise ConfigError("no workers to route to (the index has seen no events yet)")
        n = len(workers)
        turn = self._turn
        self._turn += 1
        self.decisions += 1
        kv = policy is RoutingPolicy.KV
        explain = cfg.explain or kv
        result = self.match(tokens, request, block_hashes=block_hashes) if explain else None
        n_tokens = result.num_tokens if result is not None else _len(tokens)
        adaptive = kv and cfg.overlap_weight is None
        pending, blocks, requests = self.load.columns(workers)
        weight: float | None = None
        if adaptive:
            busy = sum([p > 0.0 for p in pending]) / n  # workers with pending prefill
            self._utilisation += (busy - self._utilisation) / UTILISATION_HORIZON
            weight = factor = self.affinity_weight
            base: Sequence[Any] = pending
        else:
            if kv:
                weight = cfg.overlap_weight
            factor = cfg.overlap_weight or 0.0
            base = blocks
        matches = (
            result.matches
            if result is not None
            else [WorkerMatch(w, 0, 0.0, 0, None, None, False) for w in workers]
        )
        default_tpb = cfg.tokens_per_block or 1
        scores: list[WorkerScore]
        costs: list[float]
        if (
            _score is not None
            and type(matches) is tuple
            and type(pending) is tuple
            and type(requests) is tuple
        ):
            # the loop below in C (the same double arithmetic)
            scores, costs = _score(
                matches, pending, blocks, requests, base, n_tokens, factor, default_tpb, _new_score
            )
        else:
            scores = []
            costs = []
            add_score = scores.append
            add_cost = costs.append
            new_score = _new_score
            for m, p, b, r, q in zip(matches, pending, blocks, requests, base, strict=True):
                tpb = m.tokens_per_block or default_tpb
                # max(n_tokens - m.usable_weighted * tpb, 0.0) / tpb, inlined
                left = n_tokens - (m.weighted_blocks * tpb if m.trusted else 0.0)
                prefill = (left if left > 0.0 else 0.0) / tpb
                cost = factor * prefill + q
                add_cost(cost)
                add_score(new_score(m, r, b, prefill, cost, p))

        if policy is RoutingPolicy.ROUND_ROBIN:
            pick = turn % n
        elif policy is RoutingPolicy.RANDOM:
            pick = self._rng.randrange(n)
        else:
            # the lowest (cost,) active blocks, active requests; ties to the first worker in
            # rotation order, which starts at worker `turn mod n`
            pick = _lowest(costs if kv else None, blocks, requests, turn % n)
        if adaptive:
            chosen = scores[pick]
            keep = 1.0 - 1.0 / REUSE_HORIZON
            cm = chosen.match
            self._reused = self._reused * keep + (cm.weighted_blocks if cm.trusted else 0.0)
            self._prefilled = self._prefilled * keep + chosen.prefill_blocks
        return _new_decision(
            workers[pick], policy, n_tokens, tuple(scores) if explain else (), weight
        )


def _lowest(
    costs: Sequence[float] | None, blocks: Sequence[int], requests: Sequence[int], start: int
) -> int:
    """The index of the lowest ``(costs[i], blocks[i], requests[i])`` (without ``costs`` when
    None); on ties the first in rotation order from ``start`` (what a strict ``<`` scan of the
    keys in that order picks). The lowest cost is found first (in C): a unique one decides,
    else the keys are compared among the workers that share it."""
    n = len(blocks)
    if costs is not None:
        lo = min(costs)
        if costs.count(lo) == 1:
            return costs.index(lo)
        ties = [i for i in (*range(start, n), *range(start)) if costs[i] == lo]
    else:
        ties = [*range(start, n), *range(start)]
    pick: int = ties[0]
    best = (blocks[pick], requests[pick])
    for i in ties[1:]:
        key = (blocks[i], requests[i])
        if key < best:
            best, pick = key, i
    return pick


def _len(tokens: Any) -> int:
    try:
        return len(tokens)
    except TypeError:
        return 0

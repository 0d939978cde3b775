"""What :meth:`PrefixIndex.match <kvstream.index.index.PrefixIndex.match>` plans once per
call shape, and the per-candidate results it builds from a plan.

A :class:`MatchPlan` holds, for one shape of call (layer group, candidate list, expected
algorithm and block size) as of one index epoch, every candidate's position in the result,
the worker slots to search per domain, and the results of candidates that cannot match.
:class:`PlanCache` keeps the plans of the current epoch. :meth:`MatchPlan.results` turns the
depths the domains found into the results, in C where the extension is built
(``kvstream.index._match_native``: ``fill`` and ``zeros``), with the Python loops here as the
reference and the fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvstream._native import load as load_native
from kvstream.index.domain import HashDomain
from kvstream.index.matching import WorkerMatch, new_worker_match
from kvstream.index.table import GroupTable
from kvstream.index.types import DomainKey, WorkerKey

__all__ = ["MatchPlan", "PlanCache", "count_tokens"]

if TYPE_CHECKING:  # typed by its stub; None at run time when not loaded
    from kvstream.index._match_native import fill as _fill

    _zeros: Callable[[list[Any], dict[int, Any], Callable[..., Any], dict[Any, int]], None] | None
else:
    _match_native = load_native("kvstream.index._match_native")
    _fill = getattr(_match_native, "fill", None)
    _zeros = getattr(_match_native, "zeros", None)

_PLANS_MAX = 64
#: results a plan keeps in its zero rows (Python path: rows of every request length seen, up
#: to this many results in all; a replay's requests have a few hundred lengths)
_ZERO_CELLS = 8192

#: one matchable worker slot: (key, table, domain key, trusted, note, position, further
#: positions of the same worker listed again)
PlanRow = tuple[WorkerKey, GroupTable, DomainKey, bool, str, int, list[int]]


class MatchPlan:
    """The candidates of one match call shape as of one index epoch: per matchable worker
    slot its :data:`PlanRow`, the candidates that cannot match (``fixed``: position and
    result), and the slots to search per domain (``by_domain``: domain -> slot bit mask, in
    ``dkeys`` order). Built by the index; read-only once built."""

    __slots__ = ("_blank", "by_domain", "dkeys", "fixed", "size", "slots", "zeros")

    def __init__(self, size: int) -> None:
        self.size = size
        self.by_domain: dict[DomainKey, int] = {}
        self.dkeys: list[DomainKey] = []
        #: slot -> its row
        self.slots: dict[int, PlanRow] = {}
        self.fixed: list[tuple[int, WorkerMatch]] = []
        self._blank: list[WorkerMatch | None] | None = None
        #: request lengths per domain (``dkeys`` order) -> every candidate's result when it
        #: matches nothing (results are immutable: shared between calls)
        self.zeros: dict[tuple[int, ...], list[WorkerMatch]] = {}

    def results(
        self,
        chains_of: Mapping[DomainKey, list[list[bytes]]],
        lens: tuple[int, ...],
        domains: Mapping[DomainKey, HashDomain],
        weights: tuple[float, ...],
    ) -> list[WorkerMatch]:
        """Every candidate's result, in candidate order: each domain searched with the
        request's key chains (``chains_of``; one chain per LoRA scope, every chain of a
        domain ``lens[i]`` keys long for domain ``dkeys[i]``), a worker's depth the deepest
        over its domain's chains, its blocks weighed by ``weights`` per tier."""
        if _zeros is not None:  # the candidates nobody holds get their results last, in C
            out = self.blank()
        else:
            row = self.zeros.get(lens)
            out = (self.zero_row(lens) if row is None else row).copy()
        w0 = weights[0]
        rows = self.slots
        new = new_worker_match
        for k, n in zip(self.dkeys, lens, strict=True):
            chains = chains_of[k]
            dom = domains[k]
            allowed = self.by_domain[k]
            tpb = k.tokens_per_block
            algo = k.hash_algo
            if len(chains) == 1:  # one chain: the common case, kept tight
                hs = chains[0]
                found = dom.slot_depths(hs, allowed)
                if _fill is not None and type(found) is list:
                    # the loop below in C, but for tables with lower tiers (left to it)
                    found = _fill(out, found, rows, new, n, tpb, algo, w0)
                for slot, d in found:  # _place, inlined: once per matched worker
                    key, table, _, trusted, note, pos, more = rows[slot]
                    m = new(
                        key,
                        d,
                        table.weighted(hs, d, weights) if table.lower else d * w0,
                        n,
                        tpb,
                        algo,
                        trusted,
                        note,
                    )
                    out[pos] = m
                    for i in more:
                        out[i] = m
                continue
            # one chain per LoRA scope (token mode): each worker's deepest
            depth: dict[int, int] = {}
            pick: dict[int, int] = {}
            for i, chain in enumerate(chains):
                for slot, d in dom.slot_depths(chain, allowed):
                    if d > depth.get(slot, 0):
                        depth[slot] = d
                        pick[slot] = i
            ctx = (weights, w0, new, n, tpb, algo)
            for slot, d in depth.items():
                _place(out, rows[slot], chains[pick[slot]], d, ctx)
        if _zeros is not None:
            _zeros(out, rows, new, dict(zip(self.dkeys, lens, strict=True)))
        return out

    def blank(self) -> list[Any]:
        """A new list of the results, with only the fixed ones in place (None elsewhere)."""
        if self._blank is None:
            self._blank = [None] * self.size
            for i, m in self.fixed:
                self._blank[i] = m
        return self._blank.copy()

    def zero_row(self, lens: tuple[int, ...]) -> list[WorkerMatch]:
        """The results of a request with ``lens`` blocks per domain that nobody holds (the
        Python path's; the C path builds only the results nobody matched, ``_zeros``)."""
        out: list[WorkerMatch | None] = [None] * self.size
        for i, m in self.fixed:
            out[i] = m
        n_of = dict(zip(self.dkeys, lens, strict=True))
        for key, _, dk, trusted, note, pos, more in self.slots.values():
            m = new_worker_match(
                key, 0, 0.0, n_of[dk], dk.tokens_per_block, dk.hash_algo, trusted, note
            )
            out[pos] = m
            for i in more:
                out[i] = m
        row: list[WorkerMatch] = out  # type: ignore[assignment]
        if len(self.zeros) >= max(_PLANS_MAX, _ZERO_CELLS // max(self.size, 1)):
            # the oldest row only: clearing them all would free thousands of results at once
            del self.zeros[next(iter(self.zeros))]
        self.zeros[lens] = row
        return row


class PlanCache:
    """The match plans of the index's current epoch, by call shape (at most 64; the cache
    starts over when full or when the epoch moves on)."""

    __slots__ = ("_epoch", "_last", "_plans")

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], MatchPlan] = {}
        self._epoch = 0
        #: (candidate tuple, layer group, algorithm, block size, plan) of the last lookup
        self._last: tuple[Any, int, str | None, int | None, MatchPlan] | None = None

    def clear(self) -> None:
        """Forget every plan."""
        self._plans.clear()
        self._last = None

    def get(
        self,
        epoch: int,
        workers: Sequence[WorkerKey | tuple[str, int | None]] | None,
        build: Callable[[list[WorkerKey] | None], MatchPlan],
        *,
        layer_group_id: int,
        hash_algo: str | None,
        tokens_per_block: int | None,
    ) -> MatchPlan:
        """The plan of this call shape at index epoch ``epoch``; ``build(candidates)`` makes
        it when missing (candidates None: every worker)."""
        last = self._last
        if (
            last is not None
            and last[0] is workers
            and last[1] == layer_group_id
            and last[2] == hash_algo
            and last[3] == tokens_per_block
            and self._epoch == epoch
        ):
            return last[4]
        if self._epoch != epoch:
            self.clear()
            self._epoch = epoch
        if workers is None:
            cands = None
            ck: tuple[Any, ...] = (layer_group_id, None, hash_algo, tokens_per_block)
        else:
            cands = [WorkerKey(w[0], w[1]) for w in workers]
            ck = (layer_group_id, tuple(cands), hash_algo, tokens_per_block)
        plan = self._plans.get(ck)
        if plan is None:
            plan = build(cands)
            if len(self._plans) >= _PLANS_MAX:
                self._plans.clear()
            self._plans[ck] = plan
        if type(workers) is tuple and all(type(w) is WorkerKey for w in workers):
            # an immutable candidate list (a router's): the next call with this very tuple
            # skips the key building above (the cache holds it, so its id is not reused)
            self._last = (workers, layer_group_id, hash_algo, tokens_per_block, plan)
        return plan


#: what every worker of one domain's match shares: tier weights, the first weight, the
#: WorkerMatch constructor, blocks in the request, tokens per block, hash algorithm
_Ctx = tuple[tuple[float, ...], float, Callable[..., WorkerMatch], int, int, str]


def _place(out: list[Any], row: PlanRow, hs: list[bytes], d: int, ctx: _Ctx) -> None:
    # One worker's WorkerMatch at depth d, at its position and its duplicates' in ``out``.
    key, table, _, trusted, note, pos, more = row
    weights, w0, new, n, tpb, algo = ctx
    m = new(
        key,
        d,
        table.weighted(hs, d, weights) if table.lower else d * w0,
        n,
        tpb,
        algo,
        trusted,
        note,
    )
    out[pos] = m
    for i in more:
        out[i] = m


def count_tokens(tokens: Any) -> int:
    """``len(tokens)``, or 0 for a token container without a length."""
    try:
        return len(tokens)
    except TypeError:
        return 0

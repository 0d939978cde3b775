"""What one replay measured (:class:`ReplayResult`) and the per-worker share of it.

Counting rules, the same for every policy so that rows compare:

- every trace request is either **served** or **unservable** (its prompt needs more blocks
  than a worker's whole cache); nothing else is dropped;
- hit ratio and ceiling both count the served requests' prompt blocks, so the ceiling (an
  unlimited cache shared by everyone, same counting) is at most 100% and at least the ratio
  of any policy;
- times are simulated seconds: ``queue_s`` from arrival to the start of the request's
  prefill (waiting for cache room and for the worker's earlier prefills), ``ttft_s`` that
  plus ``(prompt - cached tokens) / prefill rate``.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvstream.kafka_security import redact_url

if TYPE_CHECKING:
    from kvstream.cli.replay_run import ReplayOptions

__all__ = ["LoadSample", "ReplayResult", "RequestRecord", "WorkerSummary", "quantile"]


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank; 0.0 for no values)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)]


@dataclass
class WorkerSummary:
    """One worker's share: requests, prompt blocks, blocks reused, evictions."""

    worker: str
    requests: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    prefill_tokens: int = 0
    evictions: int = 0

    @property
    def hit_ratio(self) -> float:
        """Reused over prompt blocks."""
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0


@dataclass(frozen=True, slots=True)
class LoadSample:
    """Per worker at simulated time ``t_s``: requests running (admitted, unfinished) and
    waiting in its queue."""

    t_s: float
    running: tuple[int, ...]
    waiting: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One served request: its trace row (``index``, arrival order), the worker it ran on,
    its arrival, queueing delay and modelled time to first token (simulated seconds), and
    its prompt blocks and the blocks it reused."""

    index: int
    worker: int
    arrival_s: float
    queue_s: float
    ttft_s: float
    prompt_blocks: int
    hit_blocks: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (times rounded to microseconds)."""
        return {
            "index": self.index,
            "worker": self.worker,
            "arrival_s": round(self.arrival_s, 6),
            "queue_s": round(self.queue_s, 6),
            "ttft_s": round(self.ttft_s, 6),
            "prompt_blocks": self.prompt_blocks,
            "hit_blocks": self.hit_blocks,
        }


@dataclass
class ReplayResult:
    """Everything a replay measured (see the module docstring for the counting)."""

    options: ReplayOptions
    trace_file: str = ""
    policy: str = ""
    block_size: int = 0
    trace_requests: int = 0
    requests: int = 0
    unservable: int = 0
    prompt_tokens: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    ceiling_blocks: int = 0
    predicted_equal: int = 0
    predicted_more: int = 0
    predicted_less: int = 0
    requeried: int = 0
    batches: int = 0
    events: int = 0
    wall_s: float = 0.0
    simulated_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list, repr=False)
    queue_s: list[float] = field(default_factory=list, repr=False)
    per_request: list[RequestRecord] = field(default_factory=list, repr=False)
    workers: list[WorkerSummary] = field(default_factory=list)
    timeline: list[LoadSample] = field(default_factory=list, repr=False)
    router_signals: dict[str, float] = field(default_factory=dict)
    index: dict[str, Any] = field(default_factory=dict)
    malformed: int = 0

    @property
    def hit_ratio(self) -> float:
        """Reused prompt blocks over the served requests' prompt blocks (partial last blocks
        included; with 512-token blocks: over the trace's hash ids, the measure the published
        36.6% uses)."""
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        """Reused prompt tokens over the served requests' prompt tokens."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ceiling_ratio(self) -> float:
        """The hit ratio of an unlimited cache shared by everyone, same requests and
        counting as :attr:`hit_ratio` (so at most 1.0)."""
        return self.ceiling_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def prediction_accuracy(self) -> float:
        """How often the index's predicted reuse equalled the worker's actual reuse."""
        n = self.predicted_equal + self.predicted_more + self.predicted_less
        return self.predicted_equal / n if n else 0.0

    @property
    def imbalance(self) -> float:
        """Most requests on one worker over the mean (1.0: perfectly even)."""
        counts = [w.requests for w in self.workers]
        mean = sum(counts) / len(counts) if counts else 0
        return max(counts) / mean if mean else 0.0

    @property
    def prefill_imbalance(self) -> float:
        """Most prefill tokens on one worker over the mean."""
        work = [w.prefill_tokens for w in self.workers]
        mean = sum(work) / len(work) if work else 0
        return max(work) / mean if mean else 0.0

    @property
    def requests_per_s(self) -> float:
        """Replayed requests per wall-clock second."""
        return self.requests / self.wall_s if self.wall_s else 0.0

    def ttft(self, q: float) -> float:
        """Quantile ``q`` of the modelled time to first token, seconds."""
        return quantile(self.ttft_s, q)

    def queue(self, q: float) -> float:
        """Quantile ``q`` of the queueing delay, seconds."""
        return quantile(self.queue_s, q)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able summary."""
        return {
            "options": {**asdict(self.options), "sink": redact_url(self.options.sink)},
            "policy": self.policy,
            "block_size": self.block_size,
            "trace_file": self.trace_file,
            "trace_requests": self.trace_requests,
            "requests": self.requests,
            "unservable": self.unservable,
            "prompt_tokens": self.prompt_tokens,
            "prompt_blocks": self.prompt_blocks,
            "hit_blocks": self.hit_blocks,
            "hit_ratio": round(self.hit_ratio, 6),
            "token_hit_ratio": round(self.token_hit_ratio, 6),
            "ceiling_blocks": self.ceiling_blocks,
            "ceiling_ratio": round(self.ceiling_ratio, 6),
            "prediction_accuracy": round(self.prediction_accuracy, 6),
            "predicted": {
                "equal": self.predicted_equal,
                "more_than_actual": self.predicted_more,
                "less_than_actual": self.predicted_less,
                "requeried_at_admission": self.requeried,
            },
            "imbalance": round(self.imbalance, 4),
            "prefill_imbalance": round(self.prefill_imbalance, 4),
            "ttft_s": _dist(self.ttft_s),
            "queue_s": _dist(self.queue_s),
            "wall_s": round(self.wall_s, 3),
            "requests_per_s": round(self.requests_per_s, 1),
            "simulated_s": round(self.simulated_s, 1),
            "batches": self.batches,
            "events": self.events,
            "malformed": self.malformed,
            "router_signals": {k: round(v, 6) for k, v in self.router_signals.items()},
            "workers": [{**asdict(w), "hit_ratio": round(w.hit_ratio, 6)} for w in self.workers],
            "index": self.index,
        }


def _dist(xs: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.fmean(xs), 4) if xs else 0.0,
        "p50": round(quantile(xs, 0.5), 4),
        "p90": round(quantile(xs, 0.9), 4),
        "p99": round(quantile(xs, 0.99), 4),
    }

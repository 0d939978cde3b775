"""Exponential backoff with jitter (the delays between export attempts)."""

from __future__ import annotations

import random

from .config import RetryPolicy

__all__ = ["Backoff"]


class Backoff:
    """Delays for attempts 1, 2, ...: ``initial * multiplier**n`` capped at ``max_backoff_s``,
    each scaled by a uniform factor in ``[1 - jitter, 1]`` (so retries of many sinks spread)."""

    def __init__(self, policy: RetryPolicy, rng: random.Random | None = None) -> None:
        self._policy = policy
        self._rng = rng or random.Random()
        self._attempt = 0

    def reset(self) -> None:
        """Start over at the initial delay."""
        self._attempt = 0

    def next_delay(self) -> float:
        """The delay before the next attempt (and count the attempt)."""
        p = self._policy
        base = min(p.max_backoff_s, p.initial_backoff_s * p.multiplier**self._attempt)
        if base < p.max_backoff_s:
            self._attempt += 1
        if p.jitter:
            base *= 1.0 - p.jitter * self._rng.random()
        return base

"""Several replays of one trace: ``--compare`` (policies side by side) and ``--sweep``
(the same over capacities or worker counts), each run a full :func:`run_replay`.

The trace is read once; every run replays the same rows with the same tokens, so the rows
of a comparison differ only by the policy (and the swept value).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final

from kvstream.cli.replay_result import ReplayResult
from kvstream.cli.replay_run import ReplayOptions, load_rows, normalize_policy, run_replay
from kvstream.errors import ConfigError

__all__ = ["SWEEP_PARAMS", "Comparison", "Sweep", "parse_compare", "parse_sweep", "run_many"]

#: ``--sweep`` parameters and the option each sets.
SWEEP_PARAMS: Final = {"capacity": "capacity_blocks", "workers": "workers"}


@dataclass(frozen=True)
class Sweep:
    """``param`` (``capacity`` or ``workers``) over ``values``."""

    param: str
    values: tuple[int, ...]


def parse_compare(text: str) -> list[str]:
    """``"kv,least_loaded,global_lru"`` -> normalized policy names, in order, without
    duplicates; ConfigError for an unknown or empty list."""
    out: list[str] = []
    for part in text.split(","):
        if part.strip():
            p = normalize_policy(part)
            if p not in out:
                out.append(p)
    if not out:
        raise ConfigError("--compare needs at least one policy")
    return out


def parse_sweep(text: str) -> Sweep:
    """``"capacity=1000,2000"`` or ``"workers=4,8,16"`` -> a Sweep (ConfigError otherwise)."""
    name, sep, values = text.partition("=")
    name = name.strip().lower()
    if not sep or name not in SWEEP_PARAMS:
        raise ConfigError(f"--sweep must be capacity=N,N,... or workers=N,N,..., got {text!r}")
    try:
        nums = tuple(int(v) for v in values.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"--sweep {name}= takes integers, got {values!r}") from None
    if not nums or min(nums) < 1:
        raise ConfigError(f"--sweep {name}= takes integers >= 1, got {values!r}")
    return Sweep(name, tuple(dict.fromkeys(nums)))


@dataclass
class Comparison:
    """Every run: ``results[i]`` is ``policies[i % len(policies)]`` at sweep value
    ``values[i // len(policies)]`` (one value, the base option's, without a sweep)."""

    base: ReplayOptions
    policies: list[str]
    sweep: Sweep | None
    results: list[ReplayResult] = field(default_factory=list)

    @property
    def values(self) -> tuple[int, ...]:
        """The swept values (the base option's value when nothing is swept)."""
        if self.sweep is None:
            return (self.base.capacity_blocks,)
        return self.sweep.values

    def at(self, value: int) -> list[ReplayResult]:
        """The runs at one swept value, in policy order."""
        i = self.values.index(value) * len(self.policies)
        return self.results[i : i + len(self.policies)]

    @property
    def total_runs(self) -> int:
        """Runs in the whole comparison (policies x swept values)."""
        return len(self.policies) * len(self.values)

    def finished(self) -> Comparison:
        """The runs done so far, as a comparison of its own: the policies run so far
        without a sweep, the swept values whose every policy ran with one (an interrupted
        comparison prints this)."""
        n = len(self.results)
        if self.sweep is None:
            return Comparison(self.base, self.policies[:n], None, list(self.results))
        done = n // len(self.policies)
        sweep = Sweep(self.sweep.param, self.sweep.values[:done])
        return Comparison(
            self.base, self.policies, sweep, self.results[: done * len(self.policies)]
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: the sweep, the policies and every run's summary (without the
        per-request lists)."""
        return {
            "policies": self.policies,
            "sweep": None
            if self.sweep is None
            else {"param": self.sweep.param, "values": list(self.sweep.values)},
            "runs": [r.as_dict() for r in self.results],
        }


async def run_many(
    base: ReplayOptions,
    policies: list[str],
    sweep: Sweep | None = None,
    *,
    on_run: Callable[[int, int, str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    into: Comparison | None = None,
) -> Comparison:
    """Replay ``base``'s trace once per policy (per swept value); ``on_run(i, total,
    label)`` is called before each run, ``progress(done, total)`` as its requests arrive.
    ``into``: an empty Comparison of the same base, policies and sweep to fill (so a caller
    interrupted midway still holds the runs that finished); a new one by default."""
    base.check()
    rows = load_rows(base)
    out = Comparison(base, list(policies), sweep) if into is None else into
    total = len(out.values) * len(policies)
    for value in out.values:
        if sweep is None:
            opts = base
        elif sweep.param == "capacity":
            opts = replace(base, capacity_blocks=value)
        else:
            opts = replace(base, workers=value)
        for p in policies:
            if on_run is not None:
                label = p if sweep is None else f"{p}, {sweep.param}={value}"
                on_run(len(out.results), total, label)
            run = replace(opts, router=p)
            out.results.append(await run_replay(run, rows=rows, progress=progress))
    return out

"""Configuration of the host and disk tiers below a manager's GPU pools.

A block evicted from a layer group's GPU pool moves to that group's host tier (pinned CPU
memory when the pools live on CUDA) and, when the host tier is full, on to the disk store;
a prefix hit on a lower tier brings it back (see :mod:`kvstream.cache.tiering`).

Both classes validate on construction and raise :class:`~kvstream.errors.ConfigError` naming
the field. :func:`size_host_tier` is the automatic sizing rule, a pure function.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from kvstream.errors import ConfigError

__all__ = ["DiskTierConfig", "HostTierConfig", "available_host_memory", "size_host_tier"]

_MAX_BLOCKS: Final = 2**31 - 1


def _fraction(value: object, name: str, *, upper: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not 0.0 < float(value) <= upper:
        raise ConfigError(f"{name} must be in (0, {upper}], got {value}")
    return float(value)


@dataclass(frozen=True)
class HostTierConfig:
    """The host tier: per layer group a pool of CPU blocks that GPU evictions move into.

    - ``blocks``: ``"auto"`` or one block count per layer group (0 disables a group's tier).
    - ``ratio`` (auto): host blocks per GPU block of the group.
    - ``max_memory_fraction`` (auto): the host tiers of all groups together take at most this
      fraction of the host memory available when the manager is built; every group is scaled
      down by the same factor to fit.
    - ``pinned``: page-locked memory (fast, asynchronous GPU copies); ``None`` means "when the
      GPU pools are on CUDA" (pinning needs CUDA).
    """

    blocks: Sequence[int] | Literal["auto"] = "auto"
    ratio: float = 1.0
    max_memory_fraction: float = 0.5
    pinned: bool | None = None

    def __post_init__(self) -> None:
        if self.blocks != "auto":
            given: object = self.blocks
            if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
                raise ConfigError(
                    f"host_tier.blocks must be 'auto' or a list of ints, got {given!r}"
                )
            counts = tuple(given)
            for i, n in enumerate(counts):
                if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= _MAX_BLOCKS:
                    raise ConfigError(f"host_tier.blocks[{i}] must be an int >= 0, got {n!r}")
            object.__setattr__(self, "blocks", counts)
        _fraction(self.ratio, "host_tier.ratio", upper=1e6)
        _fraction(self.max_memory_fraction, "host_tier.max_memory_fraction", upper=1.0)
        if self.pinned is not None and not isinstance(self.pinned, bool):
            raise ConfigError(f"host_tier.pinned must be a bool or None, got {self.pinned!r}")


@dataclass(frozen=True)
class DiskTierConfig:
    """The disk tier: a :class:`~kvstream.cache.disk_store.DiskStore` directory, shareable by
    any number of processes.

    - ``path``: the store's directory (created when missing).
    - ``capacity_bytes``: the most the directory may hold; least recently used files go first.
    - ``model_id``: names the model whose K/V the files hold. Together with the cache layout
      and the hash configuration it forms each layer group's namespace, so managers of
      different models (or layouts) sharing a directory never load each other's blocks.
    - ``write_through``: :meth:`KVCacheManager.persist` writes every block committed since its
      last call (so other processes can reuse blocks still on this one's GPU); otherwise a
      block reaches disk only when it falls out of the host tier (or the GPU, without one).
    - ``fsync``: fsync each file before publishing it (the checksum catches torn files either
      way; fsync only makes blocks survive power loss).
    """

    path: str | os.PathLike[str]
    capacity_bytes: int
    model_id: str = ""
    write_through: bool = False
    fsync: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ConfigError(f"disk_tier.path must be a non-empty path, got {self.path!r}")
        object.__setattr__(self, "path", Path(self.path))
        cap = self.capacity_bytes
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ConfigError(f"disk_tier.capacity_bytes must be an int >= 1, got {cap!r}")
        if not isinstance(self.model_id, str):
            raise ConfigError(f"disk_tier.model_id must be a str, got {self.model_id!r}")
        for name in ("write_through", "fsync"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"disk_tier.{name} must be a bool")


def available_host_memory() -> int:
    """Bytes of host memory available now (``MemAvailable``; free pages where that is
    unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def size_host_tier(
    config: HostTierConfig,
    gpu_blocks: Sequence[int],
    block_bytes: Sequence[int],
    available_bytes: int,
) -> list[int]:
    """Host blocks per layer group.

    Explicit counts are returned as given (ConfigError when their number differs from the
    number of groups). ``"auto"``: ``ratio`` x each group's GPU blocks, then, if the total
    exceeds ``max_memory_fraction`` x ``available_bytes``, every group scaled down by the same
    factor (rounding down).
    """
    if config.blocks != "auto":
        counts = list(config.blocks)
        if len(counts) != len(gpu_blocks):
            raise ConfigError(
                f"host_tier.blocks has {len(counts)} entries for {len(gpu_blocks)} layer groups"
            )
        return counts
    want = [min(_MAX_BLOCKS, int(n * config.ratio)) for n in gpu_blocks]
    total = sum(w * b for w, b in zip(want, block_bytes, strict=True))
    budget = int(max(0, available_bytes) * config.max_memory_fraction)
    if total <= budget:
        return want
    scale = budget / total
    return [int(w * scale) for w in want]

"""What every workload yields, deterministic pseudo-random tokens, and workload errors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from blake3 import blake3

from kvstream._types import TokenIds
from kvstream.errors import KVStreamError

__all__ = [
    "DataNotFoundError",
    "TraceFormatError",
    "WorkloadRequest",
    "pseudo_tokens",
]


class DataNotFoundError(KVStreamError, FileNotFoundError):
    """A workload's data file or directory does not exist (the message says where it looked
    and how to point kvstream at it)."""


class TraceFormatError(KVStreamError, ValueError):
    """A trace file holds a malformed row (the message names the file, line and field)."""


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload, in arrival order.

    ``prompt`` is the full prompt; ``output`` the tokens the "model" generates for it (a
    replay appends them); ``arrival_ms`` its arrival time from the start of the workload.
    ``conversation``/``turn`` locate multi-turn requests (None when unknown).
    """

    request_id: str
    arrival_ms: float
    prompt: TokenIds
    output: TokenIds
    conversation: int | None = None
    turn: int | None = None


def pseudo_tokens(key: bytes, n: int, vocab_size: int) -> TokenIds:
    """``n`` token ids in ``0..vocab_size-1``, a pure function of ``key`` (BLAKE3 XOF), so
    workloads are identical on every platform and library version."""
    if n <= 0:
        return TokenIds()
    stream = blake3(b"kvstream.workloads.tokens\x00" + key).digest(length=4 * n)
    ids = np.frombuffer(stream, dtype="<u4") % np.uint32(vocab_size)
    return TokenIds.from_bytes(ids.astype("<u4", copy=False).tobytes())

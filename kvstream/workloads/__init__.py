"""Deterministic workloads for benchmarks, the demo and replays (layer L1; no torch).

- :mod:`.mooncake`: the Mooncake FAST'25 traces (``shared/data/mooncake``) turned into tokens;
- :mod:`.chat`: synthetic multi-turn chats with shared system prompts.

Both yield :class:`WorkloadRequest` objects (request id, arrival time, prompt and output
tokens) and are pure functions of their parameters and seed.
"""

from kvstream.workloads.base import (
    DataNotFoundError,
    TraceFormatError,
    WorkloadRequest,
    pseudo_tokens,
)
from kvstream.workloads.chat import ChatWorkload, multi_turn_chats
from kvstream.workloads.mooncake import (
    MOONCAKE_BLOCK_TOKENS,
    MooncakeTokens,
    TraceRow,
    data_dir,
    load_trace,
    mooncake_requests,
    trace_path,
)

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "ChatWorkload",
    "DataNotFoundError",
    "MooncakeTokens",
    "TraceFormatError",
    "TraceRow",
    "WorkloadRequest",
    "data_dir",
    "load_trace",
    "mooncake_requests",
    "multi_turn_chats",
    "pseudo_tokens",
    "trace_path",
]

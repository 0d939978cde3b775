"""Deterministic workloads for benchmarks, the demo and replays (layer L1; no torch).

- :mod:`.traces`: request traces (the shipped Mooncake FAST'25 traces; hash-id and token-id
  JSON Lines files), validated line by line;
- :mod:`.mooncake`: trace rows turned into tokens;
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
from kvstream.workloads.mooncake import MooncakeTokens, mooncake_requests
from kvstream.workloads.traces import (
    DATA_DIR_ENV,
    MOONCAKE_BLOCK_TOKENS,
    TRACE_NAMES,
    TraceRow,
    data_dir,
    infer_block_tokens,
    load_trace,
    packaged_data_dir,
    resolve_trace,
    trace_path,
)

__all__ = [
    "DATA_DIR_ENV",
    "MOONCAKE_BLOCK_TOKENS",
    "TRACE_NAMES",
    "ChatWorkload",
    "DataNotFoundError",
    "MooncakeTokens",
    "TraceFormatError",
    "TraceRow",
    "WorkloadRequest",
    "data_dir",
    "infer_block_tokens",
    "load_trace",
    "mooncake_requests",
    "multi_turn_chats",
    "packaged_data_dir",
    "pseudo_tokens",
    "resolve_trace",
    "trace_path",
]

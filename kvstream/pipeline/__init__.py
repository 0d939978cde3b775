"""The asyncio fan-out pipeline (layer L3): engine thread -> bounded queue per sink -> sinks.

The processor half of the OpenTelemetry split: the pipeline decides *when* batches are
exported (batching, linger, overflow, retries, lost markers); a :class:`kvstream.sink.Sink`
decides *where* they go.

>>> from kvstream.pipeline import Pipeline, PipelineConfig, SinkPolicy   # doctest: +SKIP
>>> async with Pipeline([MemorySink()], PipelineConfig()) as pipe:       # doctest: +SKIP
...     pipe.submit(batch)

From an engine thread, submit what ``manager.flush_events_deferred()`` returns (when not None)
instead of a built batch: the hand-off stays O(1) and the sink tasks build the models (once
for every sink).
"""

from .config import OverflowPolicy, PipelineConfig, RetryPolicy, SinkPolicy
from .errors import PipelineClosedError, PipelineError, PipelineNotStartedError
from .lost import LossLedger, event_span
from .pipeline import Pipeline
from .queue import DropReason
from .report import CloseReport, SinkReport

__all__ = [
    "CloseReport",
    "DropReason",
    "LossLedger",
    "OverflowPolicy",
    "Pipeline",
    "PipelineClosedError",
    "PipelineConfig",
    "PipelineError",
    "PipelineNotStartedError",
    "RetryPolicy",
    "SinkPolicy",
    "SinkReport",
    "event_span",
]

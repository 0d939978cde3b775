"""Errors of the pipeline (all :class:`kvstream.errors.KVStreamError`)."""

from __future__ import annotations

from kvstream.errors import KVStreamError

__all__ = ["PipelineClosedError", "PipelineError", "PipelineNotStartedError"]


class PipelineError(KVStreamError):
    """The pipeline was used in a way its lifecycle forbids."""


class PipelineClosedError(PipelineError):
    """The pipeline is closed (or closing) and cannot be started again."""


class PipelineNotStartedError(PipelineError):
    """The call needs a started pipeline (``await pipeline.start()`` or ``async with``)."""

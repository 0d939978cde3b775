"""Event sources for consumers: Kafka topics, file-sink files, the memory sink, engines.

:func:`open_source` builds one from a string: ``kafka://host:port/topic?...`` (see
:meth:`~kvstream.index.sources.kafka.KafkaSource.from_url`; aiokafka is imported only then),
an engine URL, TensorRT-LLM JSON (:mod:`.trtllm`), or a file sink directory / file path. The
memory source takes a sink object.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvstream.index.sources.base import (
    EventSource,
    Malformed,
    ReadStats,
    SourceItem,
    attribute_skipped,
    decode_message,
)
from kvstream.index.sources.memory import MemorySource

if TYPE_CHECKING:
    from kvstream.index.sources.file import FileSource

__all__ = [
    "EventSource",
    "FileSource",
    "Malformed",
    "MemorySource",
    "ReadStats",
    "SourceItem",
    "attribute_skipped",
    "decode_message",
    "open_source",
]


def open_source(
    spec: str | os.PathLike[str],
    *,
    resume_from: Mapping[str, Any] | None = None,
    follow: bool = False,
    **kwargs: Any,
) -> EventSource:
    """A source for ``spec``: a ``kafka://`` URL, a live engine (``vllm://HOST:PORT?...``,
    ``sglang://...``: see :mod:`kvstream.engines.endpoint`), TensorRT-LLM JSON (a
    ``.json``/``.jsonl``/``.ndjson`` file, ``-`` for stdin, ``trtllm+file://PATH`` or
    ``trtllm:-``: see :mod:`kvstream.index.sources.trtllm`) or a file sink directory/file.

    ``follow``: keep waiting for new data (files: poll; Kafka: without it the source stops at
    the end offsets it saw when it started). ``resume_from``: a checkpoint of the same kind.
    Extra ``kwargs`` go to the source's constructor.
    """
    text = os.fspath(spec)
    if text.startswith(("vllm://", "sglang://")):
        from kvstream.index.sources.engine import EngineSource

        return EngineSource(text, resume_from=resume_from, **kwargs)
    from kvstream.index.sources.trtllm import TrtllmSource, is_trtllm_spec

    if is_trtllm_spec(text):
        return TrtllmSource.from_spec(text, follow=follow, resume_from=resume_from, **kwargs)
    if text.startswith("kafka://"):
        from kvstream.index.sources.kafka import KafkaSource

        kwargs.setdefault("stop_at_end", not follow)
        return KafkaSource.from_url(text, resume_from=resume_from, **kwargs)
    if "://" in text and not text.startswith("file://"):
        from kvstream.index.errors import SourceError

        raise SourceError(f"unsupported stream {text!r}: use kafka://HOST:PORT/TOPIC or a path")
    from kvstream.index.sources.file import FileSource

    path = text.removeprefix("file://")
    return FileSource(
        path, follow=follow, resume_from=dict(resume_from) if resume_from else None, **kwargs
    )


def __getattr__(name: str) -> Any:
    # FileSource loads the codec (fastavro, numpy): imported when first named, so a process
    # that follows only engines (``kvstream serve --workers``) never pays for it.
    if name == "FileSource":
        from kvstream.index.sources.file import FileSource

        return FileSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

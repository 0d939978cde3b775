"""An event source that follows a live vLLM or SGLang engine over ZMQ.

``open_source("vllm://127.0.0.1:5557?replay=5558&dp_size=2")`` subscribes to every DP rank
(:mod:`kvstream.engines.zmq_sub`), decodes each payload (:mod:`kvstream.engines.vllm`) and
turns it into kvstream batches, one source per rank (:mod:`kvstream.engines.stream`):

- batches the engine published but nobody can deliver any more (a gap its replay buffer no
  longer holds, no replay endpoint, ``from=latest``) become ``lost`` markers with one id per
  missing engine batch — what was inside them is unknown;
- a payload that does not decode is counted in ``stats.malformed`` (with ``rank@seq`` and
  the reason in ``recent_malformed``) and becomes a one-id ``lost`` marker;
- frames that are not the protocol at all are counted as malformed and skipped;
- an engine restart starts a new incarnation of that rank's source.

The checkpoint is the last engine seq delivered per rank; a source built with
``resume_from=checkpoint`` asks the engine's replay buffer for what came after it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from kvstream.engines.endpoint import EngineEndpoint, parse_engine_url
from kvstream.engines.stream import EngineStream, batch_rank
from kvstream.engines.vllm import decode_payload, native_readers
from kvstream.engines.zmq_sub import BadFrame, EngineSubscriber, Frame, Gap, Restart
from kvstream.errors import ConfigError, InteropError
from kvstream.index.errors import SourceError
from kvstream.index.sources.base import EventSource, SourceItem

__all__ = ["EngineSource"]

#: engine batches read into one column batch at most (a drained burst; see _burst)
_BURST_FRAMES = 32


class EngineSource(EventSource):
    """Follow one engine endpoint (all its DP ranks); see the module docstring."""

    def __init__(
        self,
        endpoint: EngineEndpoint | str,
        *,
        resume_from: Mapping[str, Any] | None = None,
        base_rank: int = 0,
        rank_from_events: bool = False,
        columns: bool = False,
    ) -> None:
        """``base_rank``: the DP rank of the endpoint's first publisher (a service that
        registers each rank's socket on its own gives the rank here). ``rank_from_events``:
        take each batch's rank from the ``data_parallel_rank`` the engine put in it, when it
        did (as Dynamo's indexer does), instead of from the socket it came on. ``columns``:
        hand each engine batch over as a :class:`~kvstream.events.columns.ColumnBatch`
        (:meth:`~kvstream.engines.stream.EngineStream.payload_columns`: the same events, no
        model per event or block; what a publisher encodes fastest) instead of the model."""
        super().__init__()
        self.endpoint = parse_engine_url(endpoint) if isinstance(endpoint, str) else endpoint
        self.name = self.endpoint.describe()
        self.rank_from_events = rank_from_events
        self.columns = columns
        self.streams: dict[int, EngineStream] = {}
        #: subscriber socket -> the rank its batches are attributed to now
        self._rank_of = {r: base_rank + r for r in range(self.endpoint.dp_size)}
        for rank in self._rank_of.values():
            self._stream(rank)
        self._last_seq: dict[int, int] = {}
        #: an item read ahead by a burst that did not belong to it: the next one delivered
        self._held: Frame | Gap | Restart | BadFrame | None = None
        start_seqs = None
        if resume_from:
            start_seqs = self._parse_checkpoint(resume_from)
        self.subscriber = EngineSubscriber(self.endpoint, start_seqs)

    def _parse_checkpoint(self, checkpoint: Mapping[str, Any]) -> dict[int, int]:
        ranks = checkpoint.get("engine_seq")
        if not isinstance(ranks, Mapping):
            raise SourceError(f"{self.name}: not an engine checkpoint: {dict(checkpoint)!r}")
        streams = checkpoint.get("streams")
        if isinstance(streams, Mapping):  # go on with the same incarnations and ids
            for key, state in streams.items():
                try:
                    rank = int(key)
                    if not isinstance(state, Mapping):
                        raise ConfigError(f"{state!r} is not a mapping")
                    self._stream(rank).resume(state)
                except (ConfigError, ValueError) as exc:
                    raise SourceError(
                        f"{self.name}: bad checkpoint stream {key!r}: {exc}"
                    ) from None
        rank_of = checkpoint.get("rank_of")
        if isinstance(rank_of, Mapping):
            for sub, rank in rank_of.items():
                try:
                    s, r = int(sub), int(rank)
                except (TypeError, ValueError):
                    raise SourceError(
                        f"{self.name}: bad checkpoint rank {sub!r}: {rank!r}"
                    ) from None
                if s in self._rank_of and 0 <= r < 65536:
                    self._rank_of[s] = r
        out = {}
        for key, seq in ranks.items():
            try:
                rank, last = int(key), int(seq)
            except (TypeError, ValueError):
                raise SourceError(f"{self.name}: bad checkpoint entry {key!r}: {seq!r}") from None
            if not 0 <= rank < self.endpoint.dp_size or last < -1:
                raise SourceError(f"{self.name}: checkpoint rank {rank} seq {last} out of range")
            self._last_seq[rank] = last
            out[rank] = last + 1
        return out

    async def start(self) -> None:
        await self.subscriber.start()

    def waiting_ranks(self) -> list[int]:
        """Ranks from which nothing has arrived yet (the engine is not up, or a wrong port)."""
        return self.subscriber.waiting_ranks()

    async def read(self, timeout_s: float | None = None) -> SourceItem | None:
        if self.subscriber._ctx is None:
            await self.start()
        out = self.read_ready()
        if out is not None:
            return out
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            item = await self.subscriber.next(left)
            if item is None:
                return None
            out = self._take(item)
            if out is not None:
                return out

    def read_ready(self) -> SourceItem | None:
        while True:
            item = self._held
            if item is not None:
                self._held = None
            elif (item := self.subscriber.next_ready()) is None:
                return None
            out = self._take(item)
            if out is not None:
                return out

    def _take(self, item: Frame | Gap | Restart | BadFrame) -> SourceItem | None:
        out = self._handle(item)
        if out is not None:
            self.stats.batches += out.count
        return out

    def _stream(self, rank: int) -> EngineStream:
        stream = self.streams.get(rank)
        if stream is None:
            stream = self.streams[rank] = EngineStream(
                self.endpoint.instance_id, rank, self.endpoint.hash_algo
            )
        return stream

    def _handle(self, item: Frame | Gap | Restart | BadFrame) -> SourceItem | None:
        if isinstance(item, Frame):
            stream = self._stream(self._rank_of[item.rank])
            self._last_seq[item.rank] = item.seq
            dialect = self.endpoint.dialect
            try:
                if self.columns:  # one pass, payload to columns
                    burst = self._burst(item, stream)
                    if burst is not None:
                        return burst
                    return SourceItem(self._columns(item, stream, dialect))
                wire = decode_payload(
                    item.payload,
                    width=stream.width,
                    dialect=dialect,
                    split_tokens=not self.columns,
                )
            except InteropError as exc:
                self._malformed(f"rank {item.rank}@seq {item.seq}", exc)
                return SourceItem(stream.lost(1, f"engine batch seq {item.seq}: {exc}"))
            if self.rank_from_events and wire.dp_rank is not None and 0 <= wire.dp_rank < 65536:
                self._rank_of[item.rank] = wire.dp_rank
                stream = self._stream(wire.dp_rank)
            return SourceItem(stream.convert(wire))
        if isinstance(item, Gap):
            stream = self._stream(self._rank_of[item.rank])
            last = item.first_seq + item.count - 1
            self._last_seq[item.rank] = max(self._last_seq.get(item.rank, -1), last)
            reason = f"engine batches seq {item.first_seq}..{last} lost: {item.reason}"
            return SourceItem(stream.lost(item.count, reason))
        if isinstance(item, Restart):
            self._stream(self._rank_of[item.rank]).restart()
            self._last_seq.pop(item.rank, None)
            return None
        self._malformed(f"rank {item.rank}", item.reason)
        return None

    def _burst(self, item: Frame, stream: EngineStream) -> SourceItem | None:
        """``item`` and the frames of its socket ready behind it (naming the same rank as it
        when ``rank_from_events``) as one column batch
        (:class:`~kvstream.engines.stream.ColumnBurst`: what they give one by one, in one
        batch), up to the first frame the one-call reader does not take or anything else (a
        gap, a restart), which the next read delivers. None, with nothing read or changed,
        when the reader does not take ``item`` itself: the one-frame path then reads (or
        refuses) it."""
        if native_readers() is None:  # no one-call reader: nothing to gather
            return None
        if self.rank_from_events:
            try:
                rank = batch_rank(item.payload)[0]
            except ValueError:
                return None
            target = self._rank_stream(rank, stream)
            burst = target.burst(rank)  # the frames behind must name the same rank
        else:
            target = stream
            burst = target.burst()
        if burst is None or not burst.add(item.payload):
            return None
        last = item.seq
        ready = self.subscriber.next_ready
        while burst.count < _BURST_FRAMES:
            nxt = ready()
            if nxt is None:
                break
            if not (isinstance(nxt, Frame) and nxt.rank == item.rank and burst.add(nxt.payload)):
                self._held = nxt
                break
            last = nxt.seq
        self._last_seq[item.rank] = last
        return SourceItem(self._took(item.rank, target, burst.finish()), count=burst.count)

    def _columns(self, item: Frame, stream: EngineStream, dialect: Any) -> Any:
        """One frame's columns, from the stream of the rank the batch names when
        ``rank_from_events``; InteropError (nothing changed) for a payload that does not
        decode."""
        if not self.rank_from_events:
            return stream.payload_columns(item.payload, dialect)
        try:
            rank, typed = batch_rank(item.payload)
        except ValueError:  # not the usual shape: the general decoder reads (or refuses) it
            wire = decode_payload(
                item.payload, width=stream.width, dialect=dialect, split_tokens=False
            )
            target = self._rank_stream(wire.dp_rank, stream)
            return self._took(item.rank, target, target.convert_columns(wire))
        target = self._rank_stream(rank, stream)
        return self._took(
            item.rank, target, target.payload_columns(item.payload, dialect, typed=typed)
        )

    def _rank_stream(self, rank: int | None, stream: EngineStream) -> EngineStream:
        """The stream of the rank a batch names (``stream``, the socket's, when it names
        none or one out of range)."""
        if rank is not None and 0 <= rank < 65536 and rank != stream.rank:
            return self._stream(rank)
        return stream

    def _took(self, socket_rank: int, stream: EngineStream, cols: Any) -> Any:
        """Once a batch converted: the socket's batches go to ``stream``'s rank from now."""
        if stream.rank is not None:
            self._rank_of[socket_rank] = stream.rank
        return cols

    def checkpoint(self) -> dict[str, Any]:
        """The last engine seq delivered per socket, and each stream's incarnation and next
        event id, so a source resumed from it continues the same incarnations (a consumer's
        restored index keeps its state) instead of starting new ones."""
        return {
            "engine_seq": {str(r): s for r, s in sorted(self._last_seq.items())},
            "streams": {str(r): st.state() for r, st in sorted(self.streams.items())},
            "rank_of": {str(s): r for s, r in sorted(self._rank_of.items())},
        }

    async def aclose(self) -> None:
        await self.subscriber.aclose()
        self.ended = True

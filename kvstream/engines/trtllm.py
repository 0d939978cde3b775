"""TensorRT-LLM's JSON KV-cache events: conversion both ways, and an in-process pump.

TensorRT-LLM's ``LLM.get_kv_cache_events()`` and ``POST /kv_cache_events`` return a list of
dicts shaped by its ``KVCacheEventSerializer``::

    {"event_id": 1, "data": {"type": "stored", ...}, "window_size": 4096,
     "attention_dp_rank": 1,            # only under attention data parallelism
     "hash_algo": "v2_sha256",          # V2 managers only; V1 events carry none
     "layer_group_id": 0}               # V2 managers only

:func:`from_trtllm_events` turns such a list into :class:`~kvstream.events.model.EventBatch`
objects (one per attention-DP rank), :func:`to_trtllm_events` writes batches back in the same
shape. :func:`from_trtllm_event` / :func:`to_trtllm_event` convert one event, and
:class:`TrtllmEventReader` keeps the little state that matters across successive reads of one
engine (each ``POST /kv_cache_events`` drains the engine's queue). :func:`pump` polls a live
``LLM`` in-process, as NVIDIA Dynamo's TensorRT-LLM worker does, and hands the batches to a
pipeline.

Every shape the serializers, managers and bridges have published is read; the corpus under
``tests/data/trtllm/shapes/`` (with its manifest naming each source) pins them.

Contracts
=========

Errors. Malformed input (a missing field, a wrong type, an unknown ``type`` tag, bad hex, a hash
of the wrong width, an out-of-range integer) raises :class:`~kvstream.errors.InteropError` whose
message starts with the location, e.g.
``event[3].data.blocks[1].block_hash: expected hex string of 64 chars ...``; never ``KeyError``
or ``TypeError``. A value the event model rejects (:class:`~kvstream.errors.EventValidationError`)
is re-raised as an ``InteropError`` with the same location prefix (the original is chained as
``__cause__``). Bad *arguments* (an empty ``instance_id``, ``tokens_per_block=0``) raise
:class:`~kvstream.errors.ConfigError`. :meth:`TrtllmEventReader.read_tolerant` keeps the good
events of a list and reports each bad one instead of failing the whole list.

Defaults when reading (what TensorRT-LLM omits or leaves null):

- ``hash_algo`` missing or null: ``data.hash_algo`` (TensorRT-LLM's router reads that too),
  else ``"v1_block_key"`` (V1 C++ events carry none).
- ``layer_group_id`` missing or null: 0. ``attention_dp_rank`` missing or null: no rank.
- ``event_id`` missing or null (OpenEngine-servicer and bridge shapes, the fan-out's
  ``all_cleared`` marker): numbered by the reader, see "Event ids" below.
- ``window_size`` missing, null or 0 (serializers before TensorRT-LLM #5580, OpenEngine
  shapes; V2 managers built without a window publish 0): the ``default_window_size`` argument,
  else for an ``all_cleared`` marker the largest window the reader has seen (TensorRT-LLM's
  fan-out only forwards the largest window), else
  :data:`~kvstream.events.model.UNBOUNDED_WINDOW` (a full-attention group of unknown length).
- In a stored block: ``token_extra_id`` 0, ``cache_level`` 0, ``priority`` 35, ``mm_keys`` [],
  ``cache_salt`` null, ``parent_hash`` null. All-zero extra ids become
  ``token_extra_ids=None``; a ``type`` tag may be omitted but must be right when present.
- ``lora_id``, ``lora_name`` and ``cache_salt`` may also sit on the stored event's ``data``
  (bridges put them there; TensorRT-LLM's OpenEngine servicer and Dynamo read them there): a
  block without its own value takes the ``data``-level one; a block's own value wins.
- In an ``mm_key``: ``start_offset`` 0 (as TensorRT-LLM's OpenEngine servicer reads it).
- Unknown keys are ignored (newer serializers may add fields).

Event ids. TensorRT-LLM numbers events from 0 per producer and attention-DP rank. Events
without ``event_id`` are numbered per rank, contiguously, continuing across successive reads
of one :class:`TrtllmEventReader`: a run of ``k`` such events after the rank's previous event
``p`` (from this read or an earlier one; none: -1) and before its next numbered event ``n`` in
the same read takes ``n-k .. n-1`` when those lie above ``p`` (so ids stay strictly increasing
and the fan-out's ``all_cleared`` marker lands on the last lost id, right before the events it
precedes), else ``p+1 .. p+k`` (also when no numbered event follows). :func:`from_trtllm_event`
has no stream and requires ``event_id``.

Hashes (TensorRT-LLM reference §1.3). An int is a 64-bit hash: the unsigned form (which may
exceed 2^63) or the signed int64 wire form (wrapped to unsigned). A str is hex. The width is
enforced from :data:`kvstream._types.BLOCK_HASH_WIDTHS`: ``v1_block_key``/``v2_sha256_64`` take
an int (or 16 hex chars), ``v2_sha256`` takes 64 hex chars and rejects ints (TensorRT-LLM never
publishes a 256-bit hash as an int, and accepting one would silently widen a mislabelled
``v2_sha256_64`` value). For an unknown algorithm an int is 8 bytes and hex is ``len/2`` bytes.
When writing, an 8-byte hash is an unsigned int and any other width lowercase hex, so every
known algorithm gets TensorRT-LLM's representation.

Tokens. ``token_id`` ints must fit in uint32; negative int32 ids are wrapped to uint32 (as
``v1_block_key`` hashes them). ``token_extra_id`` must fit in uint32 (kvstream stores extra ids
as uint32), with one exception: the older V2 manager (``kv_cache_manager_v2/_events.py``)
published a multimodal digest token as ``token_id`` 0 with the digest's first 8 bytes,
little-endian, as a 64-bit ``token_extra_id``. Such a token (id 0, extra id above 2^32-1) is
kept as token id 0 and its item as a partial digest (the 8 bytes, zero-filled to 32) in
``mm_keys`` with ``start_offset`` 0 when the block lists none; the 64-bit extra id itself is
dropped (it does not fit, and the digest's other 24 bytes were never published).

V2 multimodal tokens (reference §3.3). TensorRT-LLM V2 puts a multimodal item into the token
stream as its raw 32-byte digest (JSON: a 64-char hex ``token_id``) followed by item tokens
``mm_token_id_offset + k`` (k >= 1; the offset is the vocabulary size). kvstream token ids are
uint32, so with ``mm_token_id_offset`` given:

- a digest token is stored as the token id ``mm_token_id_offset`` itself (item-local token 0;
  the engine never produces that id, so it is unambiguous; an int token equal to the offset is
  rejected) and the digest lives in the block's ``mm_keys`` as ``(digest, 0)``. The block's hash
  stays the engine's: re-inserting the ``start_offset == 0`` digests in order at those
  positions gives back the engine's token stream.
- if the block's ``mm_keys`` are empty (older V2 events), they are derived from the tokens: a
  digest token starts item X -> ``(X, 0)``; an int token ``t > offset`` continues the most
  recent item, which may come from an ancestor block, and the first token of each such run
  emits ``(X, t - offset)``; a text token (``t < offset``) ends the run. Non-empty ``mm_keys``
  in the JSON are taken as published (they may carry uuids). The most recent item at the end
  of each block is remembered per hash by the reader (LRU-bounded) so a later read can
  continue a chain. A continuation whose item is unknown raises ``InteropError``.
- without ``mm_token_id_offset`` a hex token raises ``InteropError`` saying so.

When writing with ``mm_token_id_offset``, the k-th token equal to the offset becomes the hex of
the block's k-th ``mm_key`` with ``start_offset == 0``; without it token ids are written as ints.

``mm_key`` hashes and uuids. V2 publishes ``{"hash": <digest hex>, "start_offset", "uuid"?}``
(additive uuid). V1's serializer puts the uuid *in place of* the digest (``"hash": "<uuid>"``).

- 64 hex chars: the digest.
- Shorter hex (e.g. a 16-char routing hash): a short mm hash. TensorRT-LLM's OpenEngine
  servicer and Dynamo read ``int(h[:16], 16)`` as the item's 64-bit hash; kvstream keeps that
  value as the digest's first 8 bytes (big-endian), zero-filled to 32, and sets no uuid. It is
  written back as 64 hex chars.
- Anything else (not hex): a uuid published in place of the digest; the digest is then unknown
  and stored as 32 zero bytes (``MmKey.hash == bytes(32)`` with ``uuid`` set means "peer
  published only the uuid"). A uuid that happens to be hex cannot be told from a (short) digest
  and is read as one.

A key with the zero digest and a uuid is always written back in the uuid-replaces-hash form;
other keys follow ``mm_uuid_mode`` (``"additive"`` by default, or ``"replaces_hash"``).

``created``. TensorRT-LLM does not publish ``tokens_per_block``; the ``tokens_per_block``
argument supplies it (no inference from stored blocks: V1 publishes partial blocks, so a
block's length does not tell the block size). A ``created`` event without either raises
``InteropError``. ``attention_kind`` is FULL unless the data carries a kvstream extension key.

Kinds TensorRT-LLM lacks. ``cleared`` is written ``{"type": "cleared"}`` and ``lost`` as
``{"type": "lost", "first_event_id", "count", "reason"}``; ``include_kvstream_kinds=False``
drops them (their ids then show as gaps, which TensorRT-LLM's own fan-out treats as lost
state). Both are accepted when reading, and so is ``{"type": "all_cleared"}``, which
TensorRT-LLM's ``KvEventFanout`` injects on an id gap (with no ``event_id`` and no
``window_size``), read as ``cleared``. The fan-out stamps its marker with
``attention_dp_rank`` 0 even for an engine without attention DP, whose events carry no rank:
so a reader that has seen events without rank and none of rank 0 gives such a marker to the
rank-less source.

kvstream extensions (written only with ``extensions=True``, always accepted when reading):
``created.tokens_per_block``, ``created.attention_kind`` and ``removed.cache_level``.
``lora_id`` and ``lora_name`` of a stored block are written whenever set (TensorRT-LLM's C++
event has ``loraId`` but no serializer emits it) and read when present.

Round trips. ``from_trtllm_events(to_trtllm_events(batch)) == [batch]`` for every batch with at
least one event, given the batch's ``instance_id``/``incarnation``/``ts_ns`` and, when it has
``created`` events, its ``tokens_per_block`` (or ``extensions=True``), plus
``mm_token_id_offset`` on both sides for V2 multimodal blocks. Losses: ``schema_version`` (read
as the current one), ``attention_kind`` and ``Removed.cache_level`` (kept with
``extensions=True``), explicit all-zero ``token_extra_ids`` (read as None), a real digest of a
key written in ``replaces_hash`` mode, and batch boundaries (batches of the same rank merge).
``to_trtllm_events(from_trtllm_events(json)) == json`` for well-formed TensorRT-LLM JSON up to
normalisation: defaults filled in, ``layer_group_id`` and ``hash_algo`` always present (unless
``include_hash_algo=False``), signed hashes and negative token ids unsigned, hex lowercase,
derived ``mm_keys`` filled in, ``data``-level LoRA/salt moved onto the blocks, short mm hashes
zero-filled, 64-bit extra ids dropped, unknown keys dropped, and ``all_cleared`` written as
``cleared`` with the assigned id and window.

Grouping. Events are grouped by ``attention_dp_rank`` (missing/null is one more source, without
rank) into one batch per rank; batches come in the order each rank is first seen and each keeps
its rank's events in input order (TensorRT-LLM's ids are monotonic per rank only).

Modules: :mod:`.trtllm_parse` (one event's JSON -> model objects), :mod:`.trtllm_reader`
(event lists -> batches, the state across reads), :mod:`.trtllm_write` (batches -> JSON) and
:mod:`.trtllm_bridge` (the in-process pump); this module is their public face.
"""

from kvstream.engines.trtllm_bridge import BatchSubmitter, KvEventsLLM, PumpStats, pump
from kvstream.engines.trtllm_parse import MmUuidMode, RankedEvent, TolerantRead
from kvstream.engines.trtllm_reader import (
    TrtllmEventReader,
    from_trtllm_event,
    from_trtllm_events,
)
from kvstream.engines.trtllm_write import to_trtllm_event, to_trtllm_events

__all__ = [
    "BatchSubmitter",
    "KvEventsLLM",
    "MmUuidMode",
    "PumpStats",
    "RankedEvent",
    "TolerantRead",
    "TrtllmEventReader",
    "from_trtllm_event",
    "from_trtllm_events",
    "pump",
    "to_trtllm_event",
    "to_trtllm_events",
]

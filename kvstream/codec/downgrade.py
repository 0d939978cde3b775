"""What writing an older schema version does with information it cannot carry.

One rule for every version: what the version would misstate or lose outright raises
EncodeError, unless the encoder was built with ``lossy=True``; what it merely lacks room for
is dropped.

Schema v3 and earlier have no packed token encodings (added in v4): their token ids are always
bit planes, so nothing is lost.

Schema v2 has no engine extra keys (``StoredBlock.extra_keys``, added in v3).

* A ``stored`` event with a block whose ``extra_keys`` is not None raises EncodeError, unless
  ``lossy=True``: then the event is written without its extra keys (the blocks, their hashes
  and every other attribute still arrive; readers see ``extra_keys=None``).

Schema v1 (TensorRT-LLM V1 events) has no ``cleared``/``lost`` kinds and no ``hash_algo``.

* Events of kinds v1 lacks, and events whose ``hash_algo`` is not ``v1_block_key`` (a v1
  reader would take their hashes for ``v1_block_key`` ones), raise EncodeError, unless the
  encoder was built with ``lossy=True``: then they are left out (consumers see an event id gap,
  which they already treat as loss).
* Extra keys: as for v2.
* Everything else v1 lacks is dropped silently: ``layer_group_id``, ``incarnation``,
  ``created.tokens_per_block``/``attention_kind`` (kvstream readers skip a ``created`` event
  without ``tokens_per_block``), and the stored blocks' ``lora_name``, ``cache_salt``,
  ``mm_keys``, ``token_extra_ids``, and ``removed.cache_level``.
"""

from __future__ import annotations

from typing import Final

from kvstream.errors import EncodeError
from kvstream.events.model import DEFAULT_HASH_ALGO, EventBatch, KVCacheEvent, Stored

__all__ = [
    "EXTRA_KEYS_SINCE",
    "KINDS_BY_VERSION",
    "PACKED_TOKENS_SINCE",
    "WRITABLE_VERSIONS",
    "events_for_version",
]

#: Event kinds each schema version can carry.
KINDS_BY_VERSION: Final[dict[int, frozenset[str]]] = {
    1: frozenset({"created", "stored", "removed", "updated"}),
    2: frozenset({"created", "stored", "removed", "updated", "cleared", "lost"}),
    3: frozenset({"created", "stored", "removed", "updated", "cleared", "lost"}),
    4: frozenset({"created", "stored", "removed", "updated", "cleared", "lost"}),
}
#: Schema versions kvstream can write.
WRITABLE_VERSIONS: Final = tuple(KINDS_BY_VERSION)
#: The first version carrying ``StoredBlock.extra_keys``.
EXTRA_KEYS_SINCE: Final = 3
#: The first version with packed token encodings (varints, zstd; kind ``STORED_PACKED``).
PACKED_TOKENS_SINCE: Final = 4


def _extra_keys_problem(ev: KVCacheEvent, version: int) -> str | None:
    data = ev.data
    if not isinstance(data, Stored):
        return None
    for i, block in enumerate(data.blocks):
        if block.extra_keys is not None:
            return (
                f"schema v{version} has no extra_keys field, and block {i} has extra keys "
                f"(encode with lossy=True to write the event without them)"
            )
    return None


def events_for_version(batch: EventBatch, version: int, *, lossy: bool) -> tuple[KVCacheEvent, ...]:
    """The events of ``batch`` that schema ``version`` will carry (see the module doc).

    Raises EncodeError for an event the version cannot carry when ``lossy`` is false.
    """
    if version >= EXTRA_KEYS_SINCE:
        return batch.events
    if version >= 2:
        if not lossy:
            for ev in batch.events:
                keys_problem = _extra_keys_problem(ev, version)
                if keys_problem is not None:
                    raise EncodeError(f"event {ev.event_id}: {keys_problem}")
        return batch.events
    kinds = KINDS_BY_VERSION[1]
    kept: list[KVCacheEvent] = []
    for ev in batch.events:
        kind = ev.data.type
        if kind not in kinds:
            problem = f"schema v{version} has no '{kind}' events"
        elif ev.hash_algo != DEFAULT_HASH_ALGO:
            problem = (
                f"schema v{version} has no hash_algo field; its readers would take "
                f"{ev.hash_algo} hashes for {DEFAULT_HASH_ALGO} ones"
            )
        else:
            if not lossy and (keys_problem := _extra_keys_problem(ev, version)) is not None:
                raise EncodeError(f"event {ev.event_id}: {keys_problem}")
            kept.append(ev)
            continue
        if not lossy:
            raise EncodeError(
                f"event {ev.event_id}: {problem} (encode with lossy=True to leave such events out)"
            )
    return tuple(kept)

"""What writing an older schema version does with information it cannot carry.

Schema v1 (TensorRT-LLM V1 events) has no ``cleared``/``lost`` kinds and no ``hash_algo``.

* Events of kinds v1 lacks, and events whose ``hash_algo`` is not ``v1_block_key`` (a v1
  reader would take their hashes for ``v1_block_key`` ones), raise EncodeError, unless the
  encoder was built with ``lossy=True``: then they are left out (consumers see an event id gap,
  which they already treat as loss).
* Everything else v1 lacks is dropped silently: ``layer_group_id``, ``incarnation``,
  ``created.tokens_per_block``/``attention_kind`` (kvstream readers skip a ``created`` event
  without ``tokens_per_block``), and the stored blocks' ``lora_name``, ``cache_salt``,
  ``mm_keys``, ``token_extra_ids``, and ``removed.cache_level``.
"""

from __future__ import annotations

from typing import Final

from kvstream.errors import EncodeError
from kvstream.events.model import DEFAULT_HASH_ALGO, EventBatch, KVCacheEvent

__all__ = ["KINDS_BY_VERSION", "events_for_version"]

#: Event kinds each schema version can carry.
KINDS_BY_VERSION: Final[dict[int, frozenset[str]]] = {
    1: frozenset({"created", "stored", "removed", "updated"}),
    2: frozenset({"created", "stored", "removed", "updated", "cleared", "lost"}),
}


def events_for_version(batch: EventBatch, version: int, *, lossy: bool) -> tuple[KVCacheEvent, ...]:
    """The events of ``batch`` that schema ``version`` will carry (see the module doc).

    Raises EncodeError for an event the version cannot carry when ``lossy`` is false.
    """
    if version >= 2:
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
            kept.append(ev)
            continue
        if not lossy:
            raise EncodeError(
                f"event {ev.event_id}: {problem} (encode with lossy=True to leave such events out)"
            )
    return tuple(kept)

"""kvstream events -> TensorRT-LLM's JSON, in the form the options choose: ``mm_key`` uuids
additive (V2) or in place of the digest (V1's serializer), kvstream's extension keys or not,
``hash_algo`` or not, kvstream's own kinds or not. The rules are in
:mod:`kvstream.engines.trtllm`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvstream._types import hash_to_hex, hash_to_int
from kvstream.engines.trtllm_parse import _UNKNOWN_DIGEST, MmUuidMode, _check_config, _fail
from kvstream.errors import ConfigError
from kvstream.events.model import (
    DEFAULT_HASH_ALGO,
    Cleared,
    Created,
    EventBatch,
    EventData,
    EventDiff,
    KVCacheEvent,
    Lost,
    MmKey,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)

__all__ = [
    "to_trtllm_event",
    "to_trtllm_events",
]


def _hash_out(block_hash: bytes) -> int | str:
    return hash_to_int(block_hash) if len(block_hash) == 8 else hash_to_hex(block_hash)


def _diff_out(diff: EventDiff | None) -> dict[str, Any] | None:
    if diff is None:
        return None
    return {"type": "event_diff", "new_value": diff.new_value, "old_value": diff.old_value}


def _mm_key_out(key: MmKey, mode: MmUuidMode) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "mm_key"}
    if key.uuid is not None and (mode == "replaces_hash" or key.hash == _UNKNOWN_DIGEST):
        out["hash"] = key.uuid
    else:
        out["hash"] = key.hash.hex()
        if key.uuid is not None:
            out["uuid"] = key.uuid
    out["start_offset"] = key.start_offset
    return out


def _tokens_out(block: StoredBlock, path: str, mm_offset: int | None) -> list[dict[str, Any]]:
    ids = block.token_ids.tolist()
    extras = block.token_extra_ids.tolist() if block.token_extra_ids is not None else None
    digests = [k for k in block.mm_keys if k.start_offset == 0] if mm_offset is not None else []
    used = 0
    out: list[dict[str, Any]] = []
    for k, tid in enumerate(ids):
        token: int | str = tid
        if mm_offset is not None and tid == mm_offset:
            if used >= len(digests):
                _fail(
                    f"{path}.token_ids[{k}]",
                    f"token id {tid} equals mm_token_id_offset (a multimodal digest token) but "
                    "the block has no unused mm_key with start_offset 0 to take the digest from",
                )
            key = digests[used]
            if key.hash == _UNKNOWN_DIGEST and key.uuid is not None:
                _fail(
                    f"{path}.token_ids[{k}]",
                    f"the digest of multimodal item {key.uuid!r} is unknown (only its uuid "
                    "was published), so its digest token cannot be written",
                )
            token = key.hash.hex()
            used += 1
        out.append(
            {
                "type": "unique_token",
                "token_id": token,
                "token_extra_id": extras[k] if extras is not None else 0,
            }
        )
    return out


def _data_out(
    data: EventData,
    path: str,
    *,
    mm_token_id_offset: int | None,
    mm_uuid_mode: MmUuidMode,
    extensions: bool,
) -> dict[str, Any]:
    if isinstance(data, Stored):
        blocks: list[dict[str, Any]] = []
        for j, b in enumerate(data.blocks):
            bpath = f"{path}.blocks[{j}]"
            block: dict[str, Any] = {
                "type": "stored_block",
                "block_hash": _hash_out(b.block_hash),
                "tokens": _tokens_out(b, bpath, mm_token_id_offset),
                "cache_level": b.cache_level,
                "priority": b.priority,
                "mm_keys": [_mm_key_out(k, mm_uuid_mode) for k in b.mm_keys],
                "cache_salt": b.cache_salt,
            }
            if b.lora_id is not None:
                block["lora_id"] = b.lora_id
            if b.lora_name is not None:
                block["lora_name"] = b.lora_name
            blocks.append(block)
        parent = None if data.parent_hash is None else _hash_out(data.parent_hash)
        return {"type": "stored", "parent_hash": parent, "blocks": blocks}
    if isinstance(data, Removed):
        out: dict[str, Any] = {
            "type": "removed",
            "block_hashes": [_hash_out(h) for h in data.block_hashes],
        }
        if extensions and data.cache_level is not None:
            out["cache_level"] = data.cache_level
        return out
    if isinstance(data, Updated):
        return {
            "type": "updated",
            "block_hash": _hash_out(data.block_hash),
            "cache_level": _diff_out(data.cache_level),
            "priority": _diff_out(data.priority),
        }
    if isinstance(data, Created):
        out = {
            "type": "created",
            "num_blocks_per_cache_level": list(data.num_blocks_per_cache_level),
        }
        if extensions:
            out["tokens_per_block"] = data.tokens_per_block
            out["attention_kind"] = data.attention_kind.value
        return out
    if isinstance(data, Lost):
        return {
            "type": "lost",
            "first_event_id": data.first_event_id,
            "count": data.count,
            "reason": data.reason,
        }
    return {"type": "cleared"}


def _event_out(
    event: KVCacheEvent,
    path: str,
    *,
    attention_dp_rank: int | None,
    include_hash_algo: bool,
    mm_token_id_offset: int | None,
    mm_uuid_mode: MmUuidMode,
    extensions: bool,
) -> dict[str, Any]:
    if not include_hash_algo and event.hash_algo != DEFAULT_HASH_ALGO:
        _fail(
            f"{path}.hash_algo",
            f"include_hash_algo=False writes TensorRT-LLM V1's shape, which readers take as "
            f"{DEFAULT_HASH_ALGO!r}; this event's hashes are {event.hash_algo!r}",
        )
    out: dict[str, Any] = {
        "event_id": event.event_id,
        "data": _data_out(
            event.data,
            f"{path}.data",
            mm_token_id_offset=mm_token_id_offset,
            mm_uuid_mode=mm_uuid_mode,
            extensions=extensions,
        ),
        "window_size": event.window_size,
    }
    if attention_dp_rank is not None:
        out["attention_dp_rank"] = attention_dp_rank
    if include_hash_algo:
        out["hash_algo"] = event.hash_algo
    out["layer_group_id"] = event.layer_group_id
    return out


def _check_write_options(mm_token_id_offset: int | None, mm_uuid_mode: str) -> None:
    _check_config(None, mm_token_id_offset, None)
    if mm_uuid_mode not in ("additive", "replaces_hash"):
        raise ConfigError(
            f"mm_uuid_mode must be 'additive' or 'replaces_hash', got {mm_uuid_mode!r}"
        )


def to_trtllm_event(
    event: KVCacheEvent,
    *,
    attention_dp_rank: int | None = None,
    include_hash_algo: bool = True,
    mm_token_id_offset: int | None = None,
    mm_uuid_mode: MmUuidMode = "additive",
    extensions: bool = False,
) -> dict[str, Any]:
    """One event as a JSON-ready dict in TensorRT-LLM's serializer shape.

    ``attention_dp_rank`` is written only when not None. ``include_hash_algo=False`` omits
    ``hash_algo`` (V1's shape) and raises :class:`~kvstream.errors.InteropError` for events
    whose algorithm is not ``v1_block_key``. ``cleared``/``lost`` are always written (see
    :func:`to_trtllm_events` for dropping them). Other options: see :func:`to_trtllm_events`.
    Errors are located under ``event``.
    """
    _check_write_options(mm_token_id_offset, mm_uuid_mode)
    return _event_out(
        event,
        "event",
        attention_dp_rank=attention_dp_rank,
        include_hash_algo=include_hash_algo,
        mm_token_id_offset=mm_token_id_offset,
        mm_uuid_mode=mm_uuid_mode,
        extensions=extensions,
    )


def to_trtllm_events(
    batches: EventBatch | Iterable[EventBatch],
    *,
    include_hash_algo: bool = True,
    include_kvstream_kinds: bool = True,
    mm_token_id_offset: int | None = None,
    mm_uuid_mode: MmUuidMode = "additive",
    extensions: bool = False,
) -> list[dict[str, Any]]:
    """Batches as the JSON-ready list TensorRT-LLM's ``get_kv_cache_events()`` returns.

    Events are written batch after batch, in order; each carries its batch's
    ``attention_dp_rank`` (omitted when None). The batch's ``instance_id``, ``incarnation``,
    ``ts_ns`` and ``schema_version`` are not written (TensorRT-LLM has no place for them).

    - ``include_hash_algo``: write ``hash_algo`` (V2's shape, the default). ``False`` writes V1's
      shape and raises :class:`~kvstream.errors.InteropError` for a non-``v1_block_key`` event.
    - ``include_kvstream_kinds``: write ``cleared``/``lost`` events (``{"type": "cleared"}``,
      ``{"type": "lost", "first_event_id", "count", "reason"}``); ``False`` drops them, which
      leaves gaps in the event ids.
    - ``mm_token_id_offset``: write each token id equal to it as the hex digest of the block's
      next ``mm_key`` with ``start_offset == 0`` (TensorRT-LLM V2 multimodal tokens); raises
      ``InteropError`` when the block has no such key left.
    - ``mm_uuid_mode``: ``"additive"`` (``uuid`` key beside the digest, V2) or
      ``"replaces_hash"`` (the uuid in place of the digest hex, V1). Keys whose digest is
      unknown are always written in the replaces-hash form.
    - ``extensions``: also write kvstream fields TensorRT-LLM lacks (``created.tokens_per_block``,
      ``created.attention_kind``, ``removed.cache_level``) so reading back loses nothing.

    Raises ``TypeError`` for an argument that is not an :class:`EventBatch` (or an iterable of
    them) and :class:`~kvstream.errors.ConfigError` for bad options.
    """
    _check_write_options(mm_token_id_offset, mm_uuid_mode)
    items = [batches] if isinstance(batches, EventBatch) else list(batches)
    out: list[dict[str, Any]] = []
    for b, batch in enumerate(items):
        if not isinstance(batch, EventBatch):
            raise TypeError(f"batches[{b}]: expected an EventBatch, got {type(batch).__name__}")
        rank = batch.source.attention_dp_rank
        for e, event in enumerate(batch.events):
            if not include_kvstream_kinds and isinstance(event.data, (Cleared, Lost)):
                continue
            out.append(
                _event_out(
                    event,
                    f"batches[{b}].events[{e}]",
                    attention_dp_rank=rank,
                    include_hash_algo=include_hash_algo,
                    mm_token_id_offset=mm_token_id_offset,
                    mm_uuid_mode=mm_uuid_mode,
                    extensions=extensions,
                )
            )
    return out


# --------------------------------------------------------------------------------------------
# In-process pump
# --------------------------------------------------------------------------------------------


#: How many malformed events :class:`PumpStats` remembers (all are counted).

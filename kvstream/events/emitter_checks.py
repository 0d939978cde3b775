"""The argument checks of :class:`~kvstream.events.emitter.EventEmitter`'s recording methods:
each value is validated (EmitterError naming the argument) and turned into what the emitter
records, before any state changes."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any, Final, SupportsIndex, cast

from kvstream._types import PRIORITY_MAX, PRIORITY_MIN, TokenIds
from kvstream.errors import EmitterError
from kvstream.events.model import MmKey

__all__: list[str] = []  # helpers of kvstream.events.emitter only


_I32_MAX: Final = 2**31 - 1
_I64_MAX: Final = 2**63 - 1
_U64_MAX: Final = 2**64 - 1


_NOT_SEQUENCES: Final = (bytes, bytearray, memoryview, str)


def _as_int(value: object, lo: int, hi: int, what: str) -> int:
    if isinstance(value, bool):
        raise EmitterError(f"{what} must be an int, got bool")
    try:
        v = operator.index(cast("SupportsIndex", value))
    except TypeError:
        raise EmitterError(f"{what} must be an int, got {type(value).__name__}") from None
    if not lo <= v <= hi:
        raise EmitterError(f"{what} must be in {lo}..{hi}, got {v}")
    return v


def _as_tokens(value: object, what: str) -> TokenIds:
    # Copies the caller's ints (it may reuse its list). Any iterable of ints is accepted,
    # numpy arrays included; bools pass as the ints they are (checking costs ~1 us a block).
    if isinstance(value, TokenIds):
        return value
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        raise EmitterError(f"{what} must be a sequence of ints, got {type(value).__name__}")
    try:
        return TokenIds(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise EmitterError(f"{what} must be a sequence of ints in 0..2**32-1: {exc}") from None


def _as_opt_str(value: object, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise EmitterError(f"{what} must be a str or None, got {type(value).__name__}")


def _hash_list(block_hashes: object) -> list[Any]:
    # A copy of a sequence of hashes (not a bytes-like object: that is one hash, not many).
    if isinstance(block_hashes, _NOT_SEQUENCES):
        raise EmitterError("block_hashes must be a sequence of hashes")
    try:
        return list(cast("Iterable[Any]", block_hashes))
    except TypeError:
        raise EmitterError(
            f"block_hashes must be a sequence of hashes, got {type(block_hashes).__name__}"
        ) from None


def _block_attrs(
    cache_level: object, priority: object, lora_id: object, lora_name: object, cache_salt: object
) -> dict[str, Any]:
    # A stored block's validated attributes other than its hash, tokens and multimodal keys.
    attrs: dict[str, Any] = {
        "cache_level": _as_int(cache_level, 0, _I32_MAX, "cache_level"),
        "priority": _as_int(priority, PRIORITY_MIN, PRIORITY_MAX, "priority"),
    }
    if lora_id is not None:
        attrs["lora_id"] = _as_int(lora_id, 0, _U64_MAX, "lora_id")
    if lora_name is not None:
        attrs["lora_name"] = _as_opt_str(lora_name, "lora_name")
    if cache_salt is not None:
        attrs["cache_salt"] = _as_opt_str(cache_salt, "cache_salt")
    return attrs


def _add_block_extras(
    attrs: dict[str, Any], token_ids: TokenIds, mm_keys: object, token_extra_ids: object
) -> None:
    # Validate a block's multimodal keys and extra token ids into its attributes.
    if mm_keys:
        if isinstance(mm_keys, (str, bytes)) or not isinstance(mm_keys, Sequence):
            raise EmitterError("mm_keys must be a sequence of MmKey")
        keys = tuple(mm_keys)
        for i, k in enumerate(keys):
            if not isinstance(k, MmKey):
                raise EmitterError(f"mm_keys[{i}] must be an MmKey, got {type(k).__name__}")
        attrs["mm_keys"] = keys
    if token_extra_ids is not None:
        extra = _as_tokens(token_extra_ids, "token_extra_ids")
        if len(extra) != len(token_ids):
            raise EmitterError(
                f"token_extra_ids has {len(extra)} entries for {len(token_ids)} tokens"
            )
        attrs["token_extra_ids"] = extra


def _diff(value: object, lo: int, hi: int, what: str) -> dict[str, int] | None:
    if value is None:
        return None
    if not isinstance(value, tuple) or len(value) != 2:
        raise EmitterError(f"{what} must be an (old, new) tuple or None, got {value!r}")
    return {
        "old_value": _as_int(value[0], lo, hi, f"{what}[0] (old)"),
        "new_value": _as_int(value[1], lo, hi, f"{what}[1] (new)"),
    }

"""Per-request state of the cache manager, multimodal items and prefix-match results."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvstream.cache.block import Block
from kvstream.cache.errors import RequestError
from kvstream.hashing import ChainState, content_digest

__all__ = ["GroupMatch", "GroupState", "MmItem", "PrefixMatch", "RequestState", "block_mm_keys"]


@dataclass(frozen=True, slots=True)
class MmItem:
    """A multimodal item (an image, ...) occupying prompt positions ``[offset, offset+length)``.

    ``digest`` is its 32-byte BLAKE3 content digest (:func:`kvstream.hashing.content_digest`);
    build one from the raw bytes with :meth:`from_content`. Blocks overlapping the item hash
    the digest, so different items behind the same placeholder tokens never share blocks and
    equal bytes do.
    """

    offset: int
    length: int
    digest: bytes
    uuid: str | None = None

    @classmethod
    def from_content(cls, data: bytes, offset: int, length: int, uuid: str | None = None) -> MmItem:
        """An item whose digest is computed from its bytes (and ``uuid``, when given)."""
        return cls(offset, length, content_digest(data, uuid), uuid)


def normalize_mm_items(items: Iterable[Any], num_tokens: int) -> tuple[MmItem, ...]:
    """Validate ``items`` (``MmItem`` or ``(bytes, offset, length)`` tuples, the bytes being
    the item's content) against a prompt of ``num_tokens``; sorted by offset."""
    out: list[MmItem] = []
    for i, given in enumerate(items):
        if isinstance(given, tuple) and len(given) == 3:
            data, offset, length = given
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise RequestError(
                    f"mm_items[{i}]: content must be bytes, got {type(data).__name__}"
                )
            for name, v in (("offset", offset), ("length", length)):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise RequestError(f"mm_items[{i}].{name} must be an int, got {v!r}")
            item = MmItem.from_content(bytes(data), offset, length)
        elif isinstance(given, MmItem):
            item = given
        else:
            raise RequestError(
                f"mm_items[{i}] must be an MmItem or (bytes, offset, length), got {given!r}"
            )
        if not isinstance(item.digest, bytes) or len(item.digest) != 32:
            raise RequestError(f"mm_items[{i}].digest must be 32 bytes")
        if item.offset < 0 or item.length < 1 or item.offset + item.length > num_tokens:
            raise RequestError(
                f"mm_items[{i}] covers [{item.offset}, {item.offset + item.length}), outside "
                f"the {num_tokens}-token prompt"
            )
        out.append(item)
    out.sort(key=lambda m: m.offset)
    return tuple(out)


def block_mm_keys(
    items: tuple[MmItem, ...], index: int, tokens_per_block: int
) -> tuple[tuple[MmItem, int], ...]:
    """The items overlapping block ``index`` with the offset, within each item, of its first
    token in the block (the ``start_offset`` of DESIGN §2.1's ``mm_keys``)."""
    lo = index * tokens_per_block
    hi = lo + tokens_per_block
    return tuple(
        (m, max(0, lo - m.offset)) for m in items if m.offset < hi and m.offset + m.length > lo
    )


class GroupState:
    """A request's blocks in one layer group.

    ``blocks[i]`` holds positions ``[i*T, (i+1)*T)``; entries before ``released`` are None
    (never taken, or released by a sliding window). ``boundary`` is the number of prompt
    tokens reused from the cache (read-only). ``pins`` maps a position whose hash another
    block already carried to that canonical block, which the request also holds so that its
    chain stays committed (the request keeps writing into its own, uncommitted block).
    """

    __slots__ = ("blocks", "boundary", "pins", "released")

    def __init__(
        self, blocks: list[Block | None], boundary: int, released: int, pins: dict[int, Block]
    ) -> None:
        self.blocks = blocks
        self.boundary = boundary
        self.released = released
        self.pins = pins


class RequestState:
    """One running request: its tokens (count and partial tail), hash chain and blocks."""

    __slots__ = (
        "cache_salt",
        "chain",
        "event_extra",
        "groups",
        "hashes",
        "importing",
        "lora_id",
        "lora_name",
        "mm_items",
        "num_tokens",
        "priority",
        "request_id",
        "tail",
        "token_parts",
    )

    def __init__(
        self,
        request_id: str,
        *,
        lora_id: int | None,
        lora_name: str | None,
        cache_salt: str | None,
        mm_items: tuple[MmItem, ...],
        priority: int,
    ) -> None:
        self.request_id = request_id
        self.lora_id = lora_id
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.mm_items = mm_items
        self.priority = priority
        #: The stored-event arguments that differ from their defaults (set by the manager,
        #: only when events are on).
        self.event_extra: dict[str, Any] = {}
        self.num_tokens = 0
        #: Little-endian u32 bytes of the tokens after the last full block.
        self.tail = b""
        #: Little-endian u32 bytes of every token (what a K/V export carries), in pieces as
        #: they came (prompt, then each append): joined only when read (token_bytes), so a
        #: request that is never exported never copies its tokens.
        self.token_parts: list[bytes] = []
        #: While K/V is being imported: per group, the first block the transfer must fill.
        self.importing: list[int] | None = None
        #: Hash chain state after the last full block.
        self.chain: ChainState | None = None
        #: Published hash of every full block, in order.
        self.hashes: list[bytes] = []
        self.groups: list[GroupState] = []

    def token_bytes(self) -> bytes:
        """Little-endian u32 bytes of every token so far (prompt plus appended)."""
        parts = self.token_parts
        if len(parts) == 1:
            return parts[0]
        joined = b"".join(parts)
        self.token_parts = [joined]
        return joined


@dataclass(frozen=True, slots=True)
class GroupMatch:
    """The prefix reuse of one layer group.

    ``matched_tokens`` is the group's reuse boundary: the K/V of every position the token at
    that position needs is cached in this group (for a sliding window, only the window before
    it), so this group need not compute positions before it. ``cached_blocks`` counts the
    cached blocks the request took (fewer than ``matched_tokens / T`` for a sliding window);
    ``onboarded_blocks`` how many of them came back from the host or disk tier.
    """

    layer_group_id: int
    matched_tokens: int
    cached_blocks: int
    onboarded_blocks: int = 0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a prompt the cache already holds, per layer group.

    Boundaries are independent per group: a short sliding window never lowers a
    full-attention group's boundary. ``reusable_tokens`` (the minimum) is where the engine's
    forward pass must start; each group then writes K/V only from its own boundary.
    """

    num_prompt_tokens: int
    groups: tuple[GroupMatch, ...]

    @property
    def reusable_tokens(self) -> int:
        """Prompt tokens every group can skip: the minimum of the group boundaries."""
        groups = self.groups
        if len(groups) == 1:
            return groups[0].matched_tokens
        return min(g.matched_tokens for g in groups)

"""KV transfer between managers (disaggregated prefill -> decode): the data that moves.

The flow, with the receiver asking only for what it lacks, per layer group::

    ticket = decode.begin_import("r1", tokens)          # reserve blocks, match own prefix
    transfer = prefill.export_kv("r1", ranges=ticket.ranges)
    decode.finish_import("r1", transfer)                 # write K/V, commit, stored events

or in one call, :func:`transfer_request` (or ``decode.import_kv("r1", full_transfer)``).
A :class:`KVTransfer` carries the request (tokens, adapter, salt, multimodal items), the
sender's layout fingerprint, and per group a half-open token range with its block list: one
block hash per block (None for a last, partial block) and the blocks' K/V as one tensor
``[blocks, layers, 2, tokens_per_block, heads, head_dim]``. :meth:`KVTransfer.to_bytes`
frames it for another process (checksummed; :meth:`KVTransfer.from_bytes` raises
:class:`~kvstream.cache.errors.TransferError` on anything malformed).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import xxhash

from kvstream._types import TokenIds
from kvstream.cache.config import DTYPES
from kvstream.cache.errors import TransferError
from kvstream.cache.request import MmItem, PrefixMatch

if TYPE_CHECKING:
    import torch

    from kvstream.cache.manager import KVCacheManager

__all__ = [
    "GroupTransfer",
    "ImportResult",
    "ImportTicket",
    "KVTransfer",
    "TokenRange",
    "transfer_request",
]

_MAGIC: Final = b"KVTX"
_VERSION: Final = 1
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length
_DIGEST: Final = 16


@dataclass(frozen=True, slots=True)
class TokenRange:
    """Positions ``[start, end)`` of a request (half-open; ``0 <= start <= end``)."""

    start: int
    end: int

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TransferError(f"TokenRange.{name} must be an int, got {v!r}")
        if not 0 <= self.start <= self.end:
            raise TransferError(f"TokenRange [{self.start}, {self.end}) is not a valid range")

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, eq=False)
class GroupTransfer:
    """One layer group's part of a transfer: blocks ``first_block ..`` covering ``tokens``.

    ``block_hashes[i]`` is the hash of block ``first_block + i``, None for a block that is
    not full within the transfer's tokens. ``kv`` holds their K/V (None from a
    metadata-only sender).
    """

    layer_group_id: int
    tokens: TokenRange
    first_block: int
    block_hashes: tuple[bytes | None, ...]
    kv: torch.Tensor | None

    @property
    def num_blocks(self) -> int:
        """Blocks carried."""
        return len(self.block_hashes)


@dataclass(frozen=True, eq=False)
class KVTransfer:
    """A request's K/V leaving one manager for another (see the module docstring).

    ``token_ids`` are the request's tokens ``[0, num_tokens)`` as little-endian uint32 bytes;
    ``layout`` is the sender's :meth:`CacheConfig.layout_fingerprint` (a receiver with another
    layout or hash configuration refuses the transfer).
    """

    request_id: str
    layout: str
    token_ids: bytes
    groups: tuple[GroupTransfer, ...]
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    priority: int = 35
    mm_items: tuple[MmItem, ...] = field(default=())

    @property
    def num_tokens(self) -> int:
        """Tokens of the request."""
        return len(self.token_ids) // 4

    @property
    def tokens(self) -> TokenIds:
        """The request's tokens."""
        return TokenIds.from_bytes(self.token_ids)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K/V carried."""
        return sum(0 if g.kv is None else g.kv.numel() * g.kv.element_size() for g in self.groups)

    def group(self, layer_group_id: int) -> GroupTransfer | None:
        """The part of ``layer_group_id``, or None when the transfer has none."""
        for g in self.groups:
            if g.layer_group_id == layer_group_id:
                return g
        return None

    # ------------------------------------------------------------------ framing

    def to_bytes(self) -> bytes:
        """One self-describing, checksummed frame (K/V copied to the CPU)."""
        import torch

        payloads: list[bytes] = []
        groups = []
        for g in self.groups:
            kv_meta = None
            if g.kv is not None:
                cpu = g.kv.detach().to("cpu").contiguous()
                payloads.append(cpu.reshape(-1).view(torch.uint8).numpy().tobytes())
                kv_meta = {"dtype": str(cpu.dtype).removeprefix("torch."), "shape": list(cpu.shape)}
            groups.append(
                {
                    "layer_group_id": g.layer_group_id,
                    "tokens": [g.tokens.start, g.tokens.end],
                    "first_block": g.first_block,
                    "block_hashes": [None if h is None else h.hex() for h in g.block_hashes],
                    "kv": kv_meta,
                }
            )
        header = {
            "request_id": self.request_id,
            "layout": self.layout,
            "num_tokens": self.num_tokens,
            "lora_id": self.lora_id,
            "lora_name": self.lora_name,
            "cache_salt": self.cache_salt,
            "priority": self.priority,
            "mm_items": [
                {"offset": m.offset, "length": m.length, "digest": m.digest.hex(), "uuid": m.uuid}
                for m in self.mm_items
            ],
            "groups": groups,
        }
        head = json.dumps(header, separators=(",", ":")).encode()
        body = b"".join(
            [_PREFIX.pack(_MAGIC, _VERSION, len(head)), head, self.token_ids, *payloads]
        )
        return body + xxhash.xxh3_128_digest(body)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> KVTransfer:
        """Parse :meth:`to_bytes` output; TransferError naming what is wrong."""
        import torch

        buf = bytes(data)
        if len(buf) < _PREFIX.size + _DIGEST:
            raise TransferError(f"KV transfer frame too short ({len(buf)} bytes)")
        body, digest = buf[:-_DIGEST], buf[-_DIGEST:]
        if xxhash.xxh3_128_digest(body) != digest:
            raise TransferError("KV transfer frame checksum mismatch (corrupt or truncated)")
        magic, version, head_len = _PREFIX.unpack_from(body)
        if magic != _MAGIC:
            raise TransferError(f"not a KV transfer frame (magic {magic!r})")
        if version != _VERSION:
            raise TransferError(f"KV transfer frame version {version} is not supported")
        at = _PREFIX.size
        try:
            header = json.loads(body[at : at + head_len])
            at += head_len
            n = _int(header["num_tokens"], "num_tokens")
            tokens = body[at : at + 4 * n]
            if len(tokens) != 4 * n:
                raise TransferError("KV transfer frame ends inside the token ids")
            at += 4 * n
            groups = []
            for i, g in enumerate(header["groups"]):
                kv = None
                if g["kv"] is not None:
                    dtype_name = g["kv"]["dtype"]
                    if dtype_name not in DTYPES:
                        raise TransferError(f"groups[{i}].kv.dtype {dtype_name!r} is unknown")
                    shape = [_int(d, f"groups[{i}].kv.shape") for d in g["kv"]["shape"]]
                    size = DTYPES[dtype_name]
                    for d in shape:
                        size *= d
                    raw = body[at : at + size]
                    if len(raw) != size:
                        raise TransferError(f"KV transfer frame ends inside group {i}'s K/V")
                    at += size
                    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                    kv = flat.view(getattr(torch, dtype_name)).reshape(shape)
                start, end = g["tokens"]
                groups.append(
                    GroupTransfer(
                        layer_group_id=_int(g["layer_group_id"], f"groups[{i}].layer_group_id"),
                        tokens=TokenRange(start, end),
                        first_block=_int(g["first_block"], f"groups[{i}].first_block"),
                        block_hashes=tuple(
                            None if h is None else bytes.fromhex(h) for h in g["block_hashes"]
                        ),
                        kv=kv,
                    )
                )
            if at != len(body):
                raise TransferError(f"KV transfer frame has {len(body) - at} trailing bytes")
            items = tuple(
                MmItem(
                    _int(m["offset"], "mm_items.offset"),
                    _int(m["length"], "mm_items.length"),
                    bytes.fromhex(m["digest"]),
                    m["uuid"],
                )
                for m in header["mm_items"]
            )
            return cls(
                request_id=str(header["request_id"]),
                layout=str(header["layout"]),
                token_ids=tokens,
                groups=tuple(groups),
                lora_id=header["lora_id"],
                lora_name=header["lora_name"],
                cache_salt=header["cache_salt"],
                priority=_int(header["priority"], "priority"),
                mm_items=items,
            )
        except TransferError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
            raise TransferError(f"malformed KV transfer header: {exc!r}") from None


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TransferError(f"{what} must be an int >= 0, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class ImportTicket:
    """What a receiver reserved for an import: per layer group, the token range it lacks
    (give it to :meth:`KVCacheManager.export_kv` as ``ranges``), and its own prefix match."""

    request_id: str
    ranges: Mapping[int, TokenRange]
    match: PrefixMatch


@dataclass(frozen=True, slots=True)
class ImportResult:
    """A finished import: blocks and K/V bytes received per group (the rest was reused)."""

    request_id: str
    received_blocks: tuple[int, ...]
    received_bytes: int


def transfer_request(
    src: KVCacheManager, dst: KVCacheManager, request_id: str, *, dst_request_id: str | None = None
) -> ImportResult:
    """Move a running request's K/V from ``src`` to ``dst`` sending only what ``dst`` lacks,
    per layer group. The request keeps running on ``src``; on ``dst`` it runs as
    ``dst_request_id`` (default: the same id). On a TransferError the import is aborted."""
    probe = src.export_kv(request_id, ranges={})  # the request, no K/V
    rid = request_id if dst_request_id is None else dst_request_id
    ticket = dst.begin_import(
        rid,
        probe.tokens,
        lora_id=probe.lora_id,
        lora_name=probe.lora_name,
        cache_salt=probe.cache_salt,
        mm_items=probe.mm_items,
        priority=probe.priority,
    )
    try:
        transfer = src.export_kv(request_id, ranges=ticket.ranges)
        return dst.finish_import(rid, transfer)
    except BaseException:
        dst.abort_import(rid)
        raise

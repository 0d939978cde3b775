"""K/V in and out: :class:`KVIO`, the role of :class:`~kvstream.cache.manager.KVCacheManager`
that reads and writes a request's K/V per layer, and exports and imports a request's blocks
between managers (disaggregated prefill: :class:`~kvstream.cache.transfer.KVTransfer`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kvstream._types import PRIORITY_DEFAULT
from kvstream.cache.admission import Admission
from kvstream.cache.errors import KVAccessError, RequestError, TransferError
from kvstream.cache.request import MmItem, RequestState
from kvstream.cache.storage import copy_blocks
from kvstream.cache.transfer import (
    GroupTransfer,
    ImportResult,
    ImportTicket,
    KVTransfer,
    TokenRange,
)
from kvstream.cache.windows import first_needed_block

if TYPE_CHECKING:
    import torch

__all__ = ["KVIO"]


class KVIO(Admission):
    """Per-layer K/V access and request transfers (see the module docstring)."""

    def kv_tensor(self, layer_group_id: int) -> torch.Tensor | None:
        """A group's K/V tensor (``[blocks, layers, 2, tokens_per_block, heads, head_dim]``),
        None in metadata-only mode."""
        gid = self._gid(layer_group_id)
        return None if self._storage is None else self._storage.tensors[gid]

    def layer_location(self, layer: int) -> tuple[int, int]:
        """``(layer_group_id, index within the group)`` of a global layer id."""
        if (
            isinstance(layer, bool)
            or not isinstance(layer, int)
            or not 0 <= layer < len(self._layers)
        ):
            raise KVAccessError(
                f"layer must be an int in 0..{len(self._layers) - 1}, got {layer!r}"
            )
        return self._layers[layer]

    def export_kv(
        self,
        request_id: str,
        start: int = 0,
        end: int | None = None,
        *,
        ranges: Mapping[int, TokenRange] | None = None,
    ) -> KVTransfer:
        """The K/V of a running request's positions ``[start, end)`` (default: all of them),
        as whole blocks per layer group, to give to another manager's :meth:`finish_import`.

        ``ranges`` (an :class:`ImportTicket`'s) replaces ``start``/``end`` per group and
        exports only the groups it names; all its ranges must end at the same position. A
        sliding-window group exports only the window that position needs. TransferError
        when positions are outside the request or left the group's window here.
        """
        req = self._get(request_id)
        if req.importing is not None:
            raise TransferError(f"request {request_id!r} is still importing its K/V")
        tpb = self._tpb
        if ranges is None:
            stop = req.num_tokens if end is None else end
            span = TokenRange(start, stop)
            wanted = dict.fromkeys(range(len(self._pools)), span)
        else:
            wanted = {self._gid(g): r for g, r in ranges.items()}
            ends = {r.end for r in wanted.values()}
            if len(ends) > 1:
                raise TransferError(f"ranges end at different positions: {sorted(ends)}")
            stop = ends.pop() if ends else req.num_tokens
        if stop > req.num_tokens:
            raise TransferError(
                f"positions up to {stop} requested but request {request_id!r} has "
                f"{req.num_tokens} tokens"
            )
        groups = []
        for gid, span in sorted(wanted.items()):
            gs = req.groups[gid]
            first = max(span.start // tpb, first_needed_block(stop, self._windows[gid], tpb))
            last = -(-stop // tpb)
            if first < last and first < gs.released:
                raise TransferError(
                    f"positions before {gs.released * tpb} of request {request_id!r} left layer "
                    f"group {gid}'s sliding window here and cannot be exported"
                )
            ids = [self._held(gs.blocks, i, gid).block_id for i in range(first, last)]
            kv = None
            if self._storage is not None and ids:
                kv = self._storage.tensors[gid][ids]
            hashes = tuple(
                req.hashes[i] if (i + 1) * tpb <= stop else None for i in range(first, last)
            )
            groups.append(
                GroupTransfer(gid, TokenRange(min(first * tpb, stop), stop), first, hashes, kv)
            )
        return KVTransfer(
            request_id=request_id,
            layout=self.config.layout_fingerprint(),
            token_ids=req.token_bytes()[: 4 * stop],
            groups=tuple(groups),
            lora_id=req.lora_id,
            lora_name=req.lora_name,
            cache_salt=req.cache_salt,
            priority=req.priority,
            mm_items=req.mm_items,
        )

    def begin_import(
        self,
        request_id: str,
        prompt_tokens: Any,
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_items: Iterable[MmItem | tuple[bytes, int, int]] = (),
        priority: int = PRIORITY_DEFAULT,
    ) -> ImportTicket:
        """Start a request whose K/V another manager computed: reuse this manager's own
        cached prefix per layer group (host and disk tiers included), reserve blocks for the
        rest and return the :class:`ImportTicket` naming, per group, the token range to
        receive. Arguments and errors as :meth:`add_request` (CacheFullError: nothing
        changed). Blocks are committed (``stored`` events) only by :meth:`finish_import`;
        until then the request cannot append tokens or be exported."""
        raw, items, hashes, chain = self._check_hashed(
            request_id,
            prompt_tokens,
            mm_items,
            lora_id=lora_id,
            lora_name=lora_name,
            cache_salt=cache_salt,
            priority=priority,
            hashed=None,
        )
        req = self._new_request(
            request_id,
            items,
            lora_id=lora_id,
            lora_name=lora_name,
            cache_salt=cache_salt,
            priority=priority,
        )
        plans, match = self._admit(req, raw, hashes, chain, importing=True)
        n = req.num_tokens
        req.importing = [max(p.k, p.first) for p in plans]
        ranges = {gid: TokenRange(min(b * self._tpb, n), n) for gid, b in enumerate(req.importing)}
        return ImportTicket(request_id, ranges, match)

    def finish_import(self, request_id: str, transfer: KVTransfer) -> ImportResult:
        """Write the received K/V into the request's reserved blocks and commit them: a
        ``stored`` event for exactly the blocks this manager did not have.

        TransferError, changing nothing (the request stays importing), when the transfer's
        layout, tokens or block hashes differ from this request's, it lacks blocks the
        ticket asked for, or its tensors have the wrong shape or dtype.
        """
        req = self._get(request_id)
        need = req.importing
        if need is None:
            raise RequestError(f"request {request_id!r} is not importing")
        parts = self._check_transfer(req, need, transfer)
        tpb = self._tpb
        nb = -(-req.num_tokens // tpb)
        received: list[int] = []
        nbytes = 0
        for gid, gt in enumerate(parts):
            gs = req.groups[gid]
            lo = need[gid]
            received.append(nb - lo)
            if self._storage is not None and gt is not None and gt.kv is not None and lo < nb:
                dst = [self._held(gs.blocks, i, gid).block_id for i in range(lo, nb)]
                rows = list(range(lo - gt.first_block, nb - gt.first_block))
                kv = gt.kv.to(self._storage.device)
                copy_blocks(self._storage.tensors[gid], dst, kv, rows)
                nbytes += len(rows) * kv[0].numel() * kv.element_size()
            if self._windows[gid] is None:  # blocks another request committed meanwhile
                pool = self._pools[gid]
                for i in range(lo, len(req.hashes)):
                    b = pool.tree.get(req.hashes[i])
                    if b is not None and b is not gs.blocks[i] and i not in gs.pins:
                        pool.touch(b)
                        gs.pins[i] = b
            self._commit(
                req=req,
                gid=gid,
                table=gs.blocks,
                hashes=req.hashes,
                tokens=req.token_bytes(),
                lo=lo,
                hi=len(req.hashes),
                tokens_base=0,
            )
        req.importing = None
        return ImportResult(request_id, tuple(received), nbytes)

    def abort_import(self, request_id: str) -> None:
        """Give up an import: free the request (its reused blocks stay cached)."""
        self.free_request(request_id)

    def import_kv(self, request_id: str, transfer: KVTransfer) -> ImportResult:
        """:meth:`begin_import` from the transfer's own request, then :meth:`finish_import`:
        for a transfer that already covers whatever this manager lacks (e.g. a full export).
        The layout is checked before anything changes; if the transfer is refused after
        that (missing blocks, other hashes or tensors), the import is aborted and the
        TransferError raised."""
        if transfer.layout != self.config.layout_fingerprint():
            raise TransferError(self._layout_mismatch(transfer))
        self.begin_import(
            request_id,
            transfer.tokens,
            lora_id=transfer.lora_id,
            lora_name=transfer.lora_name,
            cache_salt=transfer.cache_salt,
            mm_items=transfer.mm_items,
            priority=transfer.priority,
        )
        try:
            return self.finish_import(request_id, transfer)
        except BaseException:
            self.abort_import(request_id)
            raise

    def _layout_mismatch(self, transfer: KVTransfer) -> str:
        return (
            f"transfer layout {transfer.layout} differs from this manager's "
            f"{self.config.layout_fingerprint()} (tokens_per_block, hash configuration or "
            "layer groups differ)"
        )

    def _check_transfer(
        self, req: RequestState, need: list[int], transfer: KVTransfer
    ) -> list[GroupTransfer | None]:
        if not isinstance(transfer, KVTransfer):
            raise TransferError(f"expected a KVTransfer, got {type(transfer).__name__}")
        if transfer.layout != self.config.layout_fingerprint():
            raise TransferError(self._layout_mismatch(transfer))
        if transfer.token_ids != req.token_bytes():
            raise TransferError(
                f"transfer carries {transfer.num_tokens} tokens that differ from request "
                f"{req.request_id!r}'s {req.num_tokens}"
            )
        tpb = self._tpb
        nb = -(-req.num_tokens // tpb)
        parts: list[GroupTransfer | None] = []
        for gid, lo in enumerate(need):
            gt = transfer.group(gid)
            parts.append(gt)
            if lo >= nb:
                continue
            if gt is None:
                raise TransferError(f"transfer has no blocks for layer group {gid}")
            if gt.first_block > lo or gt.first_block + gt.num_blocks < nb:
                raise TransferError(
                    f"layer group {gid}: transfer carries blocks [{gt.first_block}, "
                    f"{gt.first_block + gt.num_blocks}) but blocks [{lo}, {nb}) are needed"
                )
            for i in range(lo, nb):
                want = req.hashes[i] if i < len(req.hashes) else None
                if gt.block_hashes[i - gt.first_block] != want:
                    raise TransferError(
                        f"layer group {gid}: block {i}'s hash differs from the one its tokens "
                        "give here (another hash configuration, adapter, salt or item)"
                    )
            if self._storage is None:
                continue
            if gt.kv is None:
                raise TransferError(f"layer group {gid}: transfer has no K/V (metadata-only)")
            t = self._storage.tensors[gid]
            want_shape = (gt.num_blocks, *t.shape[1:])
            if tuple(gt.kv.shape) != want_shape or gt.kv.dtype != t.dtype:
                raise TransferError(
                    f"layer group {gid}: K/V is {tuple(gt.kv.shape)} {gt.kv.dtype}, expected "
                    f"{want_shape} {t.dtype}"
                )
        return parts

    def write_kv(
        self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor, *, start: int = 0
    ) -> None:
        """Store the K and V (``[n, num_kv_heads, head_dim]`` each) of global layer ``layer``
        for the request's positions ``[start, start + n)``.

        The positions must be appended already, at or after the group's reuse boundary (the
        reused prefix is shared and read-only) and not released by a sliding window.
        Tensors are converted to the pool's dtype and device. KVAccessError otherwise.
        """
        storage = self._need_storage()
        req = self._get(request_id)
        if req.importing is not None:
            raise KVAccessError(f"request {request_id!r} is still importing its K/V")
        gid, local = self.layer_location(layer)
        spec = self.config.groups[gid]
        gs = req.groups[gid]
        shape = (spec.num_kv_heads, spec.head_dim)
        if k.dim() != 3 or tuple(k.shape[1:]) != shape or k.shape != v.shape:
            raise KVAccessError(
                f"k and v must both be [n, {shape[0]}, {shape[1]}], got {tuple(k.shape)} and "
                f"{tuple(v.shape)}"
            )
        n = int(k.shape[0])
        self._check_range(req, gid, start, start + n)
        if start < gs.boundary:
            raise KVAccessError(
                f"positions [{start}, {min(start + n, gs.boundary)}) of layer group {gid} are "
                "reused from the cache and read-only"
            )
        if n:
            storage.write(
                gid,
                self._ids(gs, start, start + n),
                layer=local,
                offset=start % self._tpb,
                k=k,
                v=v,
            )

    def read_kv(
        self, request_id: str, layer: int, *, start: int | None = None, end: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K and V (``[end - start, num_kv_heads, head_dim]``) of global layer
        ``layer`` for the request's positions ``[start, end)``.

        Defaults: ``end`` = the request's token count; ``start`` = its first held position
        (0, or for a sliding-window group the first position it has not released).
        """
        storage = self._need_storage()
        req = self._get(request_id)
        gid, local = self.layer_location(layer)
        gs = req.groups[gid]
        lo = gs.released * self._tpb if start is None else start
        hi = req.num_tokens if end is None else end
        self._check_range(req, gid, lo, hi)
        if hi == lo:
            spec = self.config.groups[gid]
            t = storage.tensors[gid]
            empty = t.new_empty((0, spec.num_kv_heads, spec.head_dim))
            return empty, empty.clone()
        return storage.read(
            gid, self._ids(gs, lo, hi), layer=local, offset=lo % self._tpb, n=hi - lo
        )

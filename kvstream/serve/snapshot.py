"""The service's snapshot: every model's index, its registrations and its feeds' positions.

One file, written atomically (:func:`kvstream.index.snapshot.write_atomic`: a crash leaves
the previous snapshot whole), all integers little-endian::

    magic    8 bytes  b"KVSSRV\\r\\n"
    hlen     u32      length of the header
    header   hlen     UTF-8 JSON: {"format": "kvstream-serve", "version": 1, "created_ns",
                      "models": [{"model_name", "routing_group", "block_size",
                      "registrations": [{"instance_id", "dp_rank", "endpoint",
                      "replay_endpoint", "engine", "hash_algo"}], "positions": {feed name:
                      checkpoint}, "length": bytes of its index snapshot}]}
    indexes           each model's index snapshot (:mod:`kvstream.index.snapshot`, with its
                      own digest), in header order
    digest   32 bytes SHA-256 of everything before it

Positions are taken in the same step as the index state they go with (no await between), so a
restart that resumes every feed from them re-reads nothing it had not applied and skips
nothing; re-read events are recognised by their ids. The same bytes answer ``GET
/snapshot``, which a restarted replica without a snapshot of its own pulls from a peer.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvstream.index.errors import SnapshotError
from kvstream.index.snapshot import decode_snapshot, encode_snapshot
from kvstream.serve.config import WorkerSpec
from kvstream.serve.models import ModelIndex, ModelKey, Registration

__all__ = ["ModelState", "decode_service_snapshot", "encode_service_snapshot", "read_snapshot"]

MAGIC: Final = b"KVSSRV\r\n"
_HEAD: Final = struct.Struct("<8sI")
_DIGEST: Final = 32
_MAX_HEADER: Final = 64 << 20


@dataclass(slots=True)
class ModelState:
    """One model restored from a snapshot: its index (registrations included) and the
    checkpoint of every feed that fed it."""

    model: ModelIndex
    positions: dict[str, Any]


def encode_service_snapshot(states: list[tuple[ModelIndex, dict[str, Any]]]) -> bytes:
    """The snapshot bytes of ``(model, feed positions)`` pairs (see the module doc)."""
    blobs: list[bytes] = []
    models = []
    for model, positions in states:
        blob = encode_snapshot(model.index, None, {"model": str(model.key)})
        blobs.append(blob)
        models.append(
            {
                "model_name": model.key.model_name,
                "routing_group": model.key.routing_group,
                "block_size": model.block_size,
                "registrations": [
                    {
                        "instance_id": r.spec.instance_id,
                        "dp_rank": r.spec.dp_rank,
                        "endpoint": r.spec.endpoint,
                        "replay_endpoint": r.spec.replay_endpoint,
                        "engine": r.engine,
                        "hash_algo": r.hash_algo,
                    }
                    for r in model.registrations.values()
                ],
                "positions": positions,
                "length": len(blob),
            }
        )
    header = {
        "format": "kvstream-serve",
        "version": 1,
        "created_ns": time.time_ns(),
        "models": models,
    }
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    body = b"".join([_HEAD.pack(MAGIC, len(head)), head, *blobs])
    return body + hashlib.sha256(body).digest()


def _field(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj or not isinstance(obj[key], kind):
        raise SnapshotError(f"service snapshot: {where}.{key} is missing or of the wrong type")
    return obj[key]


def decode_service_snapshot(data: bytes) -> list[ModelState]:
    """The models of a snapshot (registrations included, feeds not started); SnapshotError
    for a truncated, corrupt or foreign file."""
    if len(data) < _HEAD.size + _DIGEST:
        raise SnapshotError("service snapshot is truncated")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    magic, hlen = _HEAD.unpack_from(body)
    if magic != MAGIC:
        raise SnapshotError("not a kvstream service snapshot (bad magic)")
    if hashlib.sha256(body).digest() != digest:
        raise SnapshotError("service snapshot checksum mismatch (truncated or corrupt file)")
    if hlen > min(len(body) - _HEAD.size, _MAX_HEADER):
        raise SnapshotError(f"service snapshot header length {hlen} exceeds the file")
    try:
        header = json.loads(body[_HEAD.size : _HEAD.size + hlen])
    except (ValueError, RecursionError) as exc:
        raise SnapshotError(f"service snapshot header is not JSON: {exc}") from None
    if _field(header, "format", str, "header") != "kvstream-serve":
        raise SnapshotError("not a kvstream service snapshot")
    if _field(header, "version", int, "header") != 1:
        raise SnapshotError(f"service snapshot version {header['version']} is not supported")
    pos = _HEAD.size + hlen
    out: list[ModelState] = []
    for i, m in enumerate(_field(header, "models", list, "header")):
        where = f"models[{i}]"
        key = ModelKey(_field(m, "model_name", str, where), _field(m, "routing_group", str, where))
        block_size = _field(m, "block_size", int, where)
        length = _field(m, "length", int, where)
        if not 0 < length <= len(body) - pos or block_size < 1:
            raise SnapshotError(f"service snapshot: {where} is out of range")
        index = decode_snapshot(body[pos : pos + length]).index
        pos += length
        model = ModelIndex(key, block_size, index.key_mode)
        index.default_tokens_per_block = block_size
        model.index = index
        for j, r in enumerate(_field(m, "registrations", list, where)):
            rw = f"{where}.registrations[{j}]"
            spec = WorkerSpec(
                _field(r, "instance_id", int, rw),
                _field(r, "dp_rank", int, rw),
                _field(r, "endpoint", str, rw),
                r.get("replay_endpoint") if isinstance(r.get("replay_endpoint"), str) else None,
            )
            model.registrations[(spec.instance_id, spec.dp_rank)] = Registration(
                spec,
                key,
                engine=r.get("engine") if r.get("engine") in ("vllm", "sglang") else "vllm",
                hash_algo=r.get("hash_algo") if isinstance(r.get("hash_algo"), str) else None,
            )
        out.append(ModelState(model, dict(_field(m, "positions", dict, where))))
    if pos != len(body):
        raise SnapshotError("service snapshot has trailing bytes")
    return out


def read_snapshot(path: str | Path) -> list[ModelState] | None:
    """The models of the snapshot at ``path``; None when there is none; SnapshotError when
    it exists but cannot be read."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SnapshotError(f"cannot read service snapshot {p}: {exc}") from exc
    return decode_service_snapshot(data)

"""The service's indexes: one per (model name, routing group), as Dynamo's indexer keeps them.

A :class:`ModelIndex` is a Dynamo-keyed :class:`~kvstream.index.PrefixIndex` (blocks keyed by
Dynamo's local hashes chained under their parents: :mod:`kvstream.index.keys`) with the
model's block size, the registrations that feed it, and the queries Dynamo's API answers:

- :meth:`ModelIndex.query_keys` -> ``{"scores", "frequencies", "instances"}`` exactly as
  Dynamo 1.6.1 shapes it: scores in tokens per instance then DP rank (GPU copies only),
  ``instances`` with the longest match and the per-tier reach (``gpu``, ``cpu`` = GPU or host,
  ``disk`` = GPU, host or disk, each the best over the instance's ranks);
- :meth:`ModelIndex.keys_for_engine_hashes`: a request given in an engine's own block hashes
  resolved to keys through any worker that published them;
- :meth:`ModelIndex.dump`: every cached block as Dynamo's ``/dump`` lists it.

Workers are keyed in the index by ``WorkerKey(str(instance_id), dp_rank)``; a rank of None
(a stream without ranks) is reported as rank 0, as Dynamo defaults it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from kvstream.index import PrefixIndex, Router, WorkerKey
from kvstream.index.keys import DYNAMO_ALGO, KeyMode, dynamo_request_keys
from kvstream.index.token_table import is_token_table
from kvstream.index.types import DomainKey
from kvstream.serve.config import WorkerSpec
from kvstream.serve.errors import ConflictError

__all__ = ["ModelIndex", "ModelKey", "Registration"]

#: Dynamo's names of cache levels 0 (GPU), 1 (host) and 2 (disk) in ``/dump``.
TIER_NAMES: Final = ("device", "host_pinned", "disk")
_LEVEL_MASKS: Final = tuple(0xFFFF << (16 * t) for t in range(4))


class ModelKey(NamedTuple):
    """Which index: a model name and a routing group (a named tuple: looked up on every
    query, it hashes and compares in C)."""

    model_name: str
    routing_group: str

    def __str__(self) -> str:
        return f"{self.model_name}:{self.routing_group}"


@dataclass(slots=True)
class Registration:
    """One registered ZMQ publisher (an engine rank) and what the service knows of it."""

    spec: WorkerSpec
    model: ModelKey
    engine: str = "vllm"
    hash_algo: str | None = None
    #: pending (nothing heard yet), active, stale (index state untrusted), disconnected
    status: str = "pending"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class ModelIndex:
    """The index of one (model, routing group) and its block size.

    ``key_mode`` is how the index keys blocks: ``dynamo`` (the default: Dynamo's local hashes,
    which ``/query`` and ``/query_by_hash`` need), or ``engine``/``tokens`` for stream-fed
    models matched through ``/match`` and ``/route`` only (:meth:`require_dynamo`); there
    ``block_size`` is that of workers that advertise none.
    """

    def __init__(
        self, key: ModelKey, block_size: int, key_mode: KeyMode | str = KeyMode.DYNAMO
    ) -> None:
        self.key = key
        self.block_size = block_size
        self.index = PrefixIndex(
            key_mode=KeyMode.parse(key_mode), default_tokens_per_block=block_size
        )
        self.domain = DomainKey(DYNAMO_ALGO, block_size, 0)
        #: (instance_id, registered rank) -> registration
        self.registrations: dict[tuple[int, int], Registration] = {}
        #: stream sources feeding this index by name (Kafka topics, file directories)
        self.sources: set[str] = set()
        self._router: Router | None = None

    @property
    def router(self) -> Router:
        """A :class:`~kvstream.index.Router` over this index (created on first use)."""
        if self._router is None:
            self._router = Router(self.index)
        return self._router

    @property
    def key_mode(self) -> KeyMode:
        """How the index keys blocks."""
        return self.index.key_mode

    def require_dynamo(self, endpoint: str) -> None:
        """ConflictError unless the index is Dynamo-keyed (what ``endpoint`` needs)."""
        if self.index.key_mode is not KeyMode.DYNAMO:
            raise ConflictError(
                f"{endpoint} needs a dynamo-keyed index; model={self.key.model_name} "
                f"routing_group={self.key.routing_group} is {self.index.key_mode.value}-keyed: "
                "use /match or /route"
            )

    # ------------------------------------------------------------------ queries

    def token_keys(self, tokens: list[int] | bytes, lora_name: str | None) -> list[bytes]:
        """The keys of a request's full blocks (``tokens``: its token ids, or their u32 LE
        bytes; one C call when the extension is built); HashingError for a bad id."""
        return dynamo_request_keys(tokens, self.block_size, lora_name or None)

    def query_keys(self, keys: list[bytes], *, include_stale: bool = False) -> dict[str, Any]:
        """Dynamo's ``/query`` answer for a request whose block keys are ``keys``."""
        bs = self.block_size
        scores: dict[str, dict[str, int]] = {}
        instances: dict[str, dict[str, Any]] = {}
        for (inst, dp_rank), g, h, d, n in self.index.tier_match(
            self.domain, keys, include_stale=include_stale
        ):
            gpu, host, disk, depth = g * bs, h * bs, d * bs, n * bs
            entry = instances.get(inst)
            if entry is None:
                entry = instances[inst] = {
                    "longest_matched": depth,
                    "gpu": gpu,
                    "dp": {},
                    "cpu": host,
                    "disk": disk,
                }
            else:  # the instance's best rank, tier by tier
                entry["longest_matched"] = max(entry["longest_matched"], depth)
                entry["gpu"] = max(entry["gpu"], gpu)
                entry["cpu"] = max(entry["cpu"], host)
                entry["disk"] = max(entry["disk"], disk)
            if gpu:
                rank = "0" if dp_rank is None else str(dp_rank)
                ranks = scores.get(inst)
                if ranks is None:
                    ranks = scores[inst] = {}
                ranks[rank] = entry["dp"][rank] = gpu
        return {"scores": scores, "frequencies": [], "instances": instances}

    def keys_for_engine_hashes(self, hashes: Sequence[bytes]) -> list[bytes]:
        """Keys of a request given as an engine's block hashes (from its first block): each
        hash resolved through any worker holding it, up to the first nobody knows."""
        tables = [t for _, gid, t in self.index.tables() if gid == 0 and is_token_table(t)]
        out: list[bytes] = []
        for h in hashes:
            for t in tables:
                k = t.key_of(h)
                if k is not None:
                    out.append(k)
                    break
            else:
                break
        return out

    def hash_algos(self) -> set[str]:
        """The engine hash algorithms this index's workers publish."""
        out: set[str] = set()
        for w in self.index.workers():
            for g in self.index.info(w).groups:
                if g.hash_algo is not None:
                    out.add(g.hash_algo)
        return out

    # ------------------------------------------------------------------ state

    def dump(self) -> dict[str, Any]:
        """Every cached block as Dynamo's ``/dump`` lists it: ``{"block_size", "events"}``,
        one ``stored`` event per run of blocks of a worker rank and tier that chain on each
        other (engine hashes as u64 ints, ``tokens_hash`` the local hash)."""
        events: list[dict[str, Any]] = []
        for w, gid, table in self.index.tables():
            if gid != 0 or not is_token_table(table):
                continue
            inst: Any = int(w.instance_id) if w.instance_id.isdigit() else w.instance_id
            rank = 0 if w.dp_rank is None else w.dp_rank
            runs: dict[int, list[Any]] = {}
            next_id = 0
            for h, parent, key, refs in table.cached_blocks():
                for level, mask in enumerate(_LEVEL_MASKS[:3]):
                    if not refs & mask:
                        continue
                    block = {
                        "block_hash": int.from_bytes(h, "big"),
                        "tokens_hash": int.from_bytes(key[8:], "big"),
                        "mm_extra_info": None,
                    }
                    run = runs.get(level)
                    if run is not None and run[0] == parent:
                        run[1].append(block)
                        run[0] = h
                        continue
                    stored = {
                        "parent_hash": None if parent is None else int.from_bytes(parent, "big"),
                        "start_position": None,
                        "blocks": [block],
                    }
                    runs[level] = [h, stored["blocks"]]
                    events.append(
                        {
                            "worker_id": inst,
                            "storage_tier": TIER_NAMES[level],
                            "residency_domain": "worker",
                            "event": {
                                "event_id": next_id,
                                "data": {"stored": stored},
                                "dp_rank": rank,
                            },
                        }
                    )
                    next_id += 1
        return {"block_size": self.block_size, "events": events}

    def workers_of(self, instance_id: int) -> list[WorkerKey]:
        """The index's workers (ranks) of one instance."""
        name = str(instance_id)
        return [w for w in self.index.workers() if w.instance_id == name]

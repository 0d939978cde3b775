"""``kvstream serve``: a standalone KV index service any router can query over HTTP
(layer L4: app wiring over :mod:`kvstream.index`, :mod:`kvstream.engines` and the sources).

It speaks NVIDIA Dynamo's standalone-indexer API (``/register``, ``/query``,
``/query_by_hash``, ``/workers``, ``/dump``, ...; Dynamo 1.6.1's JSON, status codes and
scores), is fed by engines over ZMQ (vLLM and SGLang wire formats, replay on start and on
gaps), by Kafka topics and by file-sink directories, snapshots its state with the feeds'
positions, and adds ``/ready``, ``/route``, per-tier counts and engine-hash queries.

::

    from kvstream.serve import Client, IndexService, ServeConfig

    async with IndexService(ServeConfig(port=8090, block_size=16)) as svc:
        ...                                    # svc.url

    Client("http://127.0.0.1:8090").query(token_ids)

Modules: :mod:`.config` (settings), :mod:`.service` (state, queries, lifecycle),
:mod:`.server` (HTTP/1.1 over httptools' parser), :mod:`.http` (the route table),
:mod:`.requests` (request bodies), :mod:`.models` (one index per model and routing group),
:mod:`.feeds` (engines and streams into the indexes), :mod:`.snapshot`, :mod:`.metrics`
(request counters) and :mod:`.exposition` (``/metrics``, prometheus-client loaded at the first
scrape), :mod:`.client`, :mod:`.errors`. See ``docs/serve.md``.
"""

from kvstream.serve.client import Client
from kvstream.serve.config import ServeConfig, SourceSpec, WorkerSpec, parse_workers
from kvstream.serve.errors import (
    BadRequestError,
    ConflictError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    ServiceError,
    UnauthorizedError,
    UnavailableError,
)
from kvstream.serve.service import IndexService

__all__ = [
    "BadRequestError",
    "Client",
    "ConflictError",
    "IndexService",
    "InvalidRequestError",
    "MethodNotAllowedError",
    "NotFoundError",
    "PayloadTooLargeError",
    "ServeConfig",
    "ServiceError",
    "SourceSpec",
    "UnauthorizedError",
    "UnavailableError",
    "WorkerSpec",
    "parse_workers",
]

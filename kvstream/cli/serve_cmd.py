"""``kvstream serve``: run the KV index service (Dynamo's standalone-indexer API).

Only typer is imported at module level; the service (httptools, the index) when it runs.
Exit codes: 0 stopped by SIGTERM/SIGINT (after a last snapshot); 1 the service failed at run
time; 2 bad configuration (flags, env, config file, an unreadable snapshot, a port in use).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["serve"]


def serve(
    port: Annotated[int | None, typer.Option(help="HTTP port (default 8090).")] = None,
    host: Annotated[
        str | None,
        typer.Option(help="Address to listen on (default 127.0.0.1; 0.0.0.0 for all)."),
    ] = None,
    block_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="KV block size of the --workers and of registrations that name none.",
        ),
    ] = None,
    workers: Annotated[
        str | None,
        typer.Option(
            help='Engines to follow: "ID[:RANK]=tcp://HOST:PORT[;tcp://HOST:REPLAY_PORT],..." '
            "(Dynamo's syntax; the optional second address is the engine's replay socket).",
        ),
    ] = None,
    source: Annotated[
        list[str] | None,
        typer.Option(
            help="A stream to index: kafka://HOST:PORT/TOPIC or a file-sink directory, with "
            "model_name=, routing_group=, block_size= options. Repeatable.",
        ),
    ] = None,
    model_name: Annotated[
        str | None, typer.Option(help="Model of the --workers (default: default).")
    ] = None,
    routing_group: Annotated[
        str | None, typer.Option(help="Routing group of the --workers (default: default).")
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(help="Wire format of registered engines: vllm (default) or sglang."),
    ] = None,
    snapshot: Annotated[
        Path | None,
        typer.Option(
            help="Snapshot file: restored at start, written every --snapshot-every-s and on exit."
        ),
    ] = None,
    snapshot_every_s: Annotated[
        float | None, typer.Option(min=0.1, help="Seconds between snapshots (default 60).")
    ] = None,
    peers: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated URLs of replicas to pull the index from when there is no "
            "snapshot (Dynamo's peer recovery)."
        ),
    ] = None,
    auth_token_file: Annotated[
        Path | None,
        typer.Option(help="Require 'Authorization: Bearer TOKEN' (the file's contents)."),
    ] = None,
    tls_cert: Annotated[Path | None, typer.Option(help="Serve HTTPS: certificate (PEM).")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="Serve HTTPS: private key (PEM).")] = None,
    max_body_bytes: Annotated[
        int | None, typer.Option(help="Largest request body (default 16 MiB); 413 above.")
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option(help="Most token ids per query (default 1048576); 413 above.")
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="JSON file of settings (the flags' names with underscores); flags and "
            "KVSTREAM_SERVE_* variables override it."
        ),
    ] = None,
) -> None:
    """Serve a KV index to routers over HTTP (Dynamo's standalone-indexer API).

    Follows engines over ZMQ (--workers, or POST /register) and streams (--source).
    Query it with curl, kvstream query, or kvstream.serve.Client (docs/serve.md).
    Prints one JSON line when it listens and one when it stops.
    """
    import asyncio
    import json
    import signal

    from kvstream.errors import ConfigError, KVStreamError
    from kvstream.index.errors import SnapshotError

    try:
        import httptools  # noqa: F401 - the HTTP parser: the serve extra

        from kvstream.serve import IndexService, ServeConfig

        cfg = ServeConfig.load(
            config,
            port=port,
            host=host,
            block_size=block_size,
            workers=workers,
            sources=source or None,
            model_name=model_name,
            routing_group=routing_group,
            engine=engine,
            snapshot=snapshot,
            snapshot_every_s=snapshot_every_s,
            peers=peers,
            auth_token_file=auth_token_file,
            tls_cert=tls_cert,
            tls_key=tls_key,
            max_body_bytes=max_body_bytes,
            max_tokens=max_tokens,
        )
        service = IndexService(cfg)
    except ModuleNotFoundError as exc:
        typer.echo(
            f"error: kvstream serve needs {exc.name}: pip install 'kvstream[serve]'", err=True
        )
        raise typer.Exit(2) from None
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await service.start()
        except (ConfigError, SnapshotError) as exc:
            typer.echo(f"error: {exc}", err=True)
            return 2
        except OSError as exc:
            typer.echo(f"error: {exc}", err=True)
            return 2
        _settle_heap()
        typer.echo(
            json.dumps(
                {
                    "listening": service.url,
                    "restored_from": service.restored_from or None,
                    "models": [str(m.key) for m in service.models()],
                }
            ),
            err=False,
        )
        await stop.wait()
        try:
            await service.aclose()
        except KVStreamError as exc:  # pragma: no cover - aclose logs and goes on
            typer.echo(f"error: {exc}", err=True)
            return 1
        typer.echo(json.dumps({"stopped": True, "snapshots": service.snapshots}))
        return 0

    try:
        import uvloop

        code = uvloop.run(main())
    except ImportError:  # pragma: no cover - the serve extra installs it
        code = asyncio.run(main())
    if code:
        raise typer.Exit(code)


def _settle_heap() -> None:
    """Once the service is up: import what ingest and queries use later, then move every
    object alive now (modules, classes, the app) out of the cyclic collector's sight
    (``gc.freeze``). A full collection then walks only what was allocated since: on a
    started service it took 35-40 ms, in the middle of an ingest burst."""
    import gc

    import kvstream.engines.stream
    import kvstream.index.sources.engine  # noqa: F401

    gc.collect()
    gc.freeze()

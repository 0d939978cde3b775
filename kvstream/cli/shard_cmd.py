"""``kvstream shard``: one index shard process: an index service on shard K/N of a Kafka topic.

It runs :class:`kvstream.serve.IndexService` on one source,
``kafka://HOST:PORT/TOPIC?shard=K/N`` (or an elastic consumer-group member), in the key mode
given (``engine`` by default), so a router reaches it over the service's HTTP API
(``POST /match``, :class:`kvstream.serve.shards.RemoteShard`). It is shorthand for::

    kvstream serve --port PORT --block-size N --snapshot FILE \\
        --source "kafka://HOST:PORT/TOPIC?shard=K/N&key_mode=engine"

Register with ``app.command("shard")(shard_cmd.shard)``. Only typer is imported at module
level. Exit codes: 0 done; 1 the stream could not be read (``--no-follow``); 2 bad arguments
(shard, URL, an unreadable snapshot or one of another shard or key mode, address in use).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

__all__ = ["shard"]


def shard(
    stream: Annotated[
        str,
        typer.Argument(
            help="kafka://HOST:PORT/TOPIC (the Kafka sink's topic), with TLS/SASL options "
            "if any (security_protocol=SASL_SSL&ssl_cafile=...; see docs/kafka-security.md)."
        ),
    ],
    shard_spec: Annotated[
        str | None,
        typer.Option(
            "--shard",
            help="This process's shard K/N: the partitions p with p % N == K.",
        ),
    ] = None,
    group_id: Annotated[
        str | None,
        typer.Option(
            help="Instead of --shard: an elastic shard, a member of this consumer group "
            "(partitions it gains are read from the start, those it loses forgotten).",
        ),
    ] = None,
    listen: Annotated[
        str,
        typer.Option(help="HOST:PORT to serve HTTP on (port 0: a free one; printed)."),
    ] = "127.0.0.1:0",
    snapshot: Annotated[
        Path | None,
        typer.Option(help="Service snapshot file: resumed from when it exists, written on exit."),
    ] = None,
    snapshot_every_s: Annotated[
        float | None, typer.Option(min=0.1, help="Also snapshot every S seconds.")
    ] = None,
    key_mode: Annotated[
        str,
        typer.Option(help="How blocks are keyed: engine, tokens or dynamo (see kvstream serve)."),
    ] = "engine",
    block_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="The workers' KV block size (required; in engine and tokens mode only used "
            "for workers that advertise none).",
        ),
    ] = None,
    model_name: Annotated[
        str, typer.Option(help="The model name the router asks for (/match model_name).")
    ] = "default",
    auth_token_file: Annotated[
        Path | None, typer.Option(help="Require this bearer token on every request.")
    ] = None,
    follow: Annotated[
        bool,
        typer.Option(
            help="Keep consuming until SIGINT/SIGTERM (else catch up to the end offsets, "
            "snapshot and exit)."
        ),
    ] = True,
) -> None:
    """Consume one shard of a Kafka topic into an index service that a router fans out to.

    Prints one JSON line when it listens ({"listening": "HOST:PORT", "url": "http://...",
    "shard": "K/N" or "group G"}) and one when it ends (batches, snapshots, workers). A
    router reaches it with kvstream.serve.shards.RemoteShard; see docs/scaling.md.
    """
    import asyncio
    import json
    import logging
    import signal
    from urllib.parse import urlencode

    from kvstream.errors import ConfigError, KVStreamError
    from kvstream.index import KeyMode
    from kvstream.index.errors import SnapshotError
    from kvstream.index.shards import ShardSpec
    from kvstream.index.sources.kafka import KafkaSource

    def fail(code: int, msg: str) -> typer.Exit:
        typer.echo(f"error: {msg}", err=True)
        return typer.Exit(code)

    try:
        if (shard_spec is None) == (group_id is None):
            raise ConfigError("give exactly one of --shard K/N and --group-id GROUP")
        spec = None if shard_spec is None else ShardSpec.parse(shard_spec)
        host, sep, port = listen.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"--listen takes HOST:PORT, got {listen!r}")
        if not stream.startswith("kafka://"):
            raise ConfigError(
                f"a shard reads a Kafka topic: kafka://HOST:PORT/TOPIC, got {stream!r}"
            )
        base = KafkaSource.from_url(stream)
        if base.group_id is not None or base.partitions is not None or base.shard is not None:
            raise ConfigError("give the shard with --shard or --group-id, not in the URL")
        mode = KeyMode.parse(key_mode)
        if block_size is None:
            raise ConfigError("give --block-size (the workers' KV block size)")
        opts = {"shard": str(spec)} if spec is not None else {"group_id": group_id, "elastic": 1}
        url = f"{stream}{'&' if '?' in stream else '?'}{urlencode(opts)}"
        from kvstream.serve import IndexService, ServeConfig, SourceSpec
        from kvstream.serve.snapshot import read_snapshot

        source = SourceSpec(
            url,
            model_name=model_name,
            block_size=block_size,
            key_mode=mode,
            elastic=spec is None,
        )
        cfg = ServeConfig(
            host=host or "127.0.0.1",
            port=int(port),
            block_size=block_size,
            sources=(source,),
            snapshot=snapshot,
            snapshot_every_s=snapshot_every_s,
            auth_token_file=auth_token_file,
        )
        from kvstream.serve.feeds import StreamFeed
        from kvstream.serve.models import ModelIndex, ModelKey

        # the name the service keeps this source's offsets under in its snapshots
        feed_name = StreamFeed(source, ModelIndex(ModelKey(model_name, ""), block_size)).name
        for state in (read_snapshot(snapshot) or []) if snapshot is not None else []:
            others = sorted(set(state.positions) - {feed_name})
            if others:
                raise ConfigError(
                    f"snapshot {snapshot} was taken reading {', '.join(others)}, "
                    f"not {source.url}: give this shard its own snapshot"
                )
        service = IndexService(cfg)
    except ModuleNotFoundError as exc:
        raise fail(2, f"kvstream shard needs {exc.name}: pip install 'kvstream[serve]'") from None
    except (ConfigError, SnapshotError) as exc:
        raise fail(2, str(exc)) from None
    except KVStreamError as exc:
        raise fail(2, str(exc)) from None
    except ValueError as exc:  # pydantic's, for settings out of range
        raise fail(2, str(exc)) from None
    where = str(spec) if spec is not None else f"group {group_id}"
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")

    async def main() -> tuple[int, dict[str, Any]]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await service.start()
        except (KVStreamError, OSError) as exc:
            typer.echo(f"error: {exc}", err=True)
            return 2, {}
        line = {"listening": f"{cfg.host}:{service.port}", "url": service.url, "shard": where}
        typer.echo(json.dumps(line))
        (feed,) = service.feeds()
        code = 0
        if follow:
            await stop.wait()
        while not follow and not stop.is_set():  # catch up, then snapshot and exit
            if feed.last_error:
                typer.echo(f"error: {feed.last_error}", err=True)
                code = 1
                break
            if service.ready()[0]:
                break
            await asyncio.sleep(0.1)
        done = {
            "shard": where,
            "batches": feed.batches,
            "events": feed.events,
            "workers": len(feed.model.index.workers()),
        }
        await service.aclose(snapshot=code == 0)
        done["snapshots"] = service.snapshots
        return code, done

    code, done = asyncio.run(main())
    if done:
        typer.echo(json.dumps(done))
    if code:
        raise typer.Exit(code)

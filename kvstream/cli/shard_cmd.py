"""``kvstream shard``: one index shard process: consume shard K/N of a Kafka topic, serve matches.

Register with ``app.command("shard")(shard_cmd.shard)``. Only typer is imported at module
level; the index and aiokafka are imported when the command runs. Exit codes: 0 done; 1 the
stream could not be read; 2 bad arguments (shard, URL, unreadable or mismatched snapshot,
address in use).
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
        typer.Option(help="HOST:PORT to serve matches on (port 0: a free one; printed)."),
    ] = "127.0.0.1:0",
    snapshot: Annotated[
        Path | None,
        typer.Option(help="Snapshot file: resumed from when it exists, written on exit."),
    ] = None,
    snapshot_every: Annotated[
        int | None, typer.Option(min=1, help="Also snapshot every N batches.")
    ] = None,
    snapshot_every_s: Annotated[
        float | None, typer.Option(min=0.1, help="Also snapshot every S seconds.")
    ] = None,
    key_mode: Annotated[
        str, typer.Option(help="How blocks are keyed: engine or tokens (see kvstream index).")
    ] = "engine",
    block_size: Annotated[
        int | None,
        typer.Option(min=1, help="Block size of workers that advertise none."),
    ] = None,
    follow: Annotated[
        bool,
        typer.Option(help="Keep consuming until SIGINT/SIGTERM (else stop at the end offsets)."),
    ] = True,
) -> None:
    """Consume one shard of a Kafka topic into a prefix index and serve matches to a router.

    Prints one JSON line when it listens ({"listening": "HOST:PORT", "shard": "K/N" or
    "group G"}) and one when it ends (batches, snapshots). A router reaches it with
    kvstream.index.shard_rpc.RemoteShard; see docs/scaling.md.
    """
    import asyncio
    import json
    import signal

    from kvstream.errors import ConfigError, KVStreamError
    from kvstream.index import PrefixIndex, SnapshotError
    from kvstream.index.shard_rpc import ShardServer, serve_shard
    from kvstream.index.shards import ShardSpec, open_group_shard, open_shard
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
        from kvstream.index import KeyMode

        mode = KeyMode.parse(key_mode)
    except KVStreamError as exc:
        raise fail(2, str(exc)) from None

    def fresh() -> PrefixIndex:
        return PrefixIndex(default_tokens_per_block=block_size, key_mode=mode)

    options: dict[str, Any] = {
        "stop_at_end": not follow,
        "client_id": base.client_id,
        "schema_ids": base.schema_ids,
        "consumer_options": base.consumer_options,
        "security": base.security,
    }
    try:
        if spec is None:
            assert group_id is not None
            consumer = open_group_shard(
                snapshot,
                base.bootstrap_servers,
                base.topic,
                group_id,
                index_factory=fresh,
                **options,
            )
        else:
            consumer = open_shard(
                snapshot, base.bootstrap_servers, base.topic, spec, index_factory=fresh, **options
            )
        if consumer.index.key_mode is not mode:
            raise ConfigError(
                f"snapshot {snapshot} holds a {consumer.index.key_mode.value}-keyed index; "
                f"pass --key-mode {consumer.index.key_mode.value}"
            )
    except (SnapshotError, ConfigError) as exc:
        raise fail(2, str(exc)) from None
    except KVStreamError as exc:
        raise fail(1, str(exc)) from None
    where = str(spec) if spec is not None else f"group {group_id}"

    def listening(server: ShardServer) -> None:
        line = {"listening": f"{host or '127.0.0.1'}:{server.port}", "shard": where}
        typer.echo(json.dumps(line), nl=True)

    async def main() -> Any:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await serve_shard(
            consumer,
            host or "127.0.0.1",
            int(port),
            stop=stop if follow else None,
            on_listen=listening,
            snapshot_every_batches=snapshot_every,
            snapshot_every_s=snapshot_every_s,
        )

    try:
        report = asyncio.run(main())
    except OSError as exc:
        raise fail(2, f"{listen}: {exc}") from None
    except KVStreamError as exc:
        raise fail(1, str(exc)) from None
    done = {
        "shard": where,
        "batches": report.batches,
        "snapshots": report.snapshots,
        "workers": len(consumer.index.workers()),
        "source": consumer.source.stats.as_dict(),
    }
    typer.echo(json.dumps(done))

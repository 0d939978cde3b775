"""``kvstream index``: build a prefix index from an event stream and answer queries.

Register with ``app.command("index")(index_cmd.index)``. Exit codes: 0 done; 1 the stream
could not be read; 2 bad arguments (a missing input file, a file that holds no event batch
but only malformed input, unreadable query file, hash configuration mismatch, unreadable
snapshot).

The index, the sources and rich are imported inside the command, so ``kvstream --help``
and the other commands do not pay for them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvstream.cli.output import EXIT_RUNTIME, EXIT_USAGE, check_input_path, fail
from kvstream.errors import ConfigError, KVStreamError

if TYPE_CHECKING:
    from rich.console import Console

    from kvstream.index import (
        EventSource,
        HashRequest,
        IndexConsumer,
        KeyMode,
        MatchResult,
        PrefixIndex,
    )

__all__ = ["index"]


@dataclass(frozen=True)
class _Query:
    tokens: list[int]
    request: HashRequest


def _parse_tokens(text: str) -> list[int]:
    parts = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise ConfigError(
            f"a query is token ids separated by spaces or commas, got {text!r}"
        ) from None


def _load_queries(path: Path) -> list[_Query]:
    from kvstream.index import HashRequest

    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read queries from {path}: {exc}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{path}:{n}: not JSON ({exc})") from None
        if isinstance(obj, list):
            obj = {"tokens": obj}
        toks = obj.get("tokens") if isinstance(obj, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise ConfigError(f'{path}:{n}: expected a list of token ids or {{"tokens": [...]}}')
        req = HashRequest(
            lora_id=obj.get("lora_id"),
            lora_name=obj.get("lora_name"),
            cache_salt=obj.get("cache_salt"),
            drop_last_token=bool(obj.get("drop_last_token", True)),
        )
        out.append(_Query(toks, req))
    return out


def index(
    stream: Annotated[
        str,
        typer.Argument(help="A file sink directory or file, or kafka://HOST:PORT/TOPIC."),
    ],
    query: Annotated[
        list[str] | None,
        typer.Option("--query", "-q", help='Token ids to match, e.g. "1 2 3 4" (repeatable).'),
    ] = None,
    queries: Annotated[
        Path | None,
        typer.Option(help='JSONL file: one query per line, [ids...] or {"tokens": [...]}.'),
    ] = None,
    layer_group: Annotated[int, typer.Option(min=0, help="Layer group to match.")] = 0,
    block_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Block size of workers that advertise none (schema-v1 data); a worker "
            "advertising another one is an error.",
        ),
    ] = None,
    hash_algo: Annotated[
        str | None,
        typer.Option(help="Expected hash algorithm; a worker publishing another is an error."),
    ] = None,
    key_mode: Annotated[
        str,
        typer.Option(
            help="How blocks are keyed: engine (the engine's hashes; requests hashed with each "
            "worker's algorithm) or tokens (a canonical hash of the tokens: one index across "
            "engines and algorithms; needs token ids in the events)."
        ),
    ] = "engine",
    follow: Annotated[
        bool, typer.Option(help="Keep reading new data until --idle-timeout passes without any.")
    ] = False,
    idle_timeout: Annotated[float, typer.Option(min=0.0, help="Seconds (with --follow).")] = 2.0,
    group_id: Annotated[
        str | None, typer.Option(help="Kafka consumer group (offsets committed after snapshots).")
    ] = None,
    snapshot: Annotated[
        Path | None,
        typer.Option(help="Snapshot file: resume from it when it exists, write it at the end."),
    ] = None,
    snapshot_every: Annotated[
        int | None, typer.Option(min=1, help="Also snapshot every N batches.")
    ] = None,
    max_batches: Annotated[int | None, typer.Option(min=1, help="Stop after N batches.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Build a prefix index from a KV-event stream, then print per-worker matches for the
    queries (and the state of every worker)."""
    import asyncio

    from rich.console import Console

    from kvstream.hashing.registry import check_hash_algo
    from kvstream.index import HashConfigMismatchError, HashRequest, KeyMode, SnapshotError

    err = Console(stderr=True)
    try:
        if hash_algo is not None:  # requests are hashed with it: it must be one kvstream has
            check_hash_algo(hash_algo, where="--hash-algo")
        qs = [_Query(_parse_tokens(q), HashRequest()) for q in query or []]
        if queries is not None:
            qs += _load_queries(queries)
        mode = KeyMode.parse(key_mode)
        check_input_path(stream)
        consumer = _consumer(stream, follow, idle_timeout, group_id, snapshot, block_size, mode)
        asyncio.run(_build(consumer, max_batches, snapshot_every))
        _check_read(stream, consumer)
        results = [
            consumer.index.match(
                q.tokens,
                layer_group_id=layer_group,
                request=q.request,
                hash_algo=hash_algo,
                tokens_per_block=block_size,
            )
            for q in qs
        ]
    except (ConfigError, SnapshotError, HashConfigMismatchError, FileNotFoundError) as exc:
        fail(err, str(exc), EXIT_USAGE)
    except (KVStreamError, OSError, TimeoutError) as exc:
        fail(err, f"{type(exc).__name__}: {exc}", EXIT_RUNTIME)
    if as_json:
        typer.echo(json.dumps(_as_json(stream, consumer, qs, results)))
    else:
        _print(stream, consumer, qs, results, Console())


def _consumer(
    stream: str,
    follow: bool,
    idle_timeout: float,
    group_id: str | None,
    snapshot: Path | None,
    block_size: int | None,
    key_mode: KeyMode,
) -> IndexConsumer:
    from kvstream.index import IndexConsumer, PrefixIndex, open_source

    def make(ckpt: dict[str, Any] | None) -> EventSource:
        kw: dict[str, Any] = {}
        if stream.startswith("kafka://"):
            if group_id:
                kw["group_id"] = group_id
        elif follow:
            kw["idle_timeout_s"] = idle_timeout
        return open_source(stream, resume_from=ckpt, follow=follow, **kw)

    def fresh() -> PrefixIndex:
        return PrefixIndex(default_tokens_per_block=block_size, key_mode=key_mode)

    if snapshot is not None:
        consumer = IndexConsumer.resume(snapshot, make, index_factory=fresh)
        if consumer.index.key_mode is not key_mode:
            raise ConfigError(
                f"snapshot {snapshot} holds a {consumer.index.key_mode.value}-keyed index; "
                f"pass --key-mode {consumer.index.key_mode.value} (or start a new snapshot)"
            )
        if block_size is not None:
            consumer.index.default_tokens_per_block = block_size
        return consumer
    return IndexConsumer(make(None), fresh())


def _check_read(stream: str, consumer: IndexConsumer) -> None:
    """ConfigError when the stream held nothing but malformed input (e.g. a file that is
    not an event file): an empty table would say the stream is empty, which it is not."""
    src = consumer.source.stats
    if consumer.batches or not src.malformed:
        return
    from kvstream.kafka_security import redact_url

    first = list(consumer.source.recent_malformed)[:1]
    why = f": {first[0].where}: {first[0].error}" if first else ""
    raise ConfigError(
        f"{redact_url(stream)} is not a kvstream event stream: {src.malformed} malformed "
        f"input(s), no batch read{why}"
    )


async def _build(consumer: IndexConsumer, max_batches: int | None, every: int | None) -> None:
    async with consumer.source:
        await consumer.run(max_batches=max_batches, snapshot_every_batches=every)


def _as_json(
    stream: str, consumer: IndexConsumer, qs: list[_Query], results: list[MatchResult]
) -> dict[str, Any]:
    idx = consumer.index
    workers = []
    for w in idx.workers():
        info = idx.info(w)
        workers.append(
            {
                "worker": str(w),
                "incarnation": info.incarnation,
                "stale": info.stale,
                "stale_reason": info.stale_reason,
                "groups": [
                    {
                        "layer_group_id": g.layer_group_id,
                        "hash_algo": g.hash_algo,
                        "tokens_per_block": g.tokens_per_block,
                        "blocks": g.blocks,
                        "rooted_blocks": g.rooted_blocks,
                    }
                    for g in info.groups
                ],
                "stats": info.stats.as_dict(),
            }
        )
    from kvstream.kafka_security import redact_url

    return {
        "stream": redact_url(stream),
        "batches": consumer.batches,
        "snapshots": consumer.snapshots,
        "source": consumer.source.stats.as_dict(),
        "malformed": [
            {"where": m.where, "error": m.error} for m in consumer.source.recent_malformed
        ],
        "index": idx.stats().as_dict(),
        "workers": workers,
        "queries": [
            {"tokens": len(q.tokens), "matches": r.as_list()}
            for q, r in zip(qs, results, strict=True)
        ],
    }


def _print(
    stream: str,
    consumer: IndexConsumer,
    qs: list[_Query],
    results: list[MatchResult],
    out: Console,
) -> None:
    from rich.table import Table

    from kvstream.kafka_security import redact_url

    idx = consumer.index
    st = idx.stats()
    src = consumer.source.stats
    out.print(
        f"[bold]kvstream index[/bold] {redact_url(stream)}: {consumer.batches:,} batches applied, "
        f"{st.workers} workers ({st.stale_workers} stale), {st.blocks:,} cached blocks, "
        f"{src.malformed} malformed inputs skipped"
    )
    for bad in consumer.source.recent_malformed:
        out.print(f"  [yellow]skipped[/yellow] {bad.where}: {bad.error}", highlight=False)
    t = Table(title="Workers", title_justify="left")
    for col in ("worker", "state", "hashing", "blocks", "events", "repairs"):
        t.add_column(col)
    for w in idx.workers():
        info = idx.info(w)
        s = info.stats
        state = f"[red]stale[/red]: {info.stale_reason}" if info.stale else "[green]ok[/green]"
        hashing = ", ".join(
            f"g{g.layer_group_id}: {g.hash_algo} x {g.tokens_per_block or '?'}" for g in info.groups
        )
        blocks = sum(g.blocks for g in info.groups)
        repairs = (
            f"dup {s.duplicate_events + s.duplicate_stores}, unknown "
            f"{s.unknown_removes + s.unknown_parent_stores}, gaps {s.gaps}, lost {s.lost_events}"
        )
        t.add_row(str(w), state, hashing, f"{blocks:,}", f"{s.events:,}", repairs)
    out.print(t)
    for i, (q, r) in enumerate(zip(qs, results, strict=True), 1):
        qt = Table(title=f"Query {i}: {len(q.tokens)} tokens", title_justify="left")
        for col in ("worker", "matched blocks", "matched tokens", "weighted", "of", "note"):
            qt.add_column(col, justify="left" if col in ("worker", "note") else "right")
        for m in sorted(r, key=lambda m: (-m.usable_blocks, str(m.worker))):
            qt.add_row(
                str(m.worker),
                str(m.matched_blocks),
                str(m.matched_tokens),
                f"{m.weighted_blocks:g}",
                str(m.request_blocks),
                m.note,
            )
        out.print(qt)

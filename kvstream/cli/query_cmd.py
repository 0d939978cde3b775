"""``kvstream query``: ask an index service (kvstream serve, or Dynamo's indexer) for the
cached prefixes of a request, and print them as a table or JSON.

Exit codes: 0 answered; 1 the service could not be reached or failed; 2 bad arguments or
a request the service refused (4xx).
"""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["query"]


def query(
    url: Annotated[str, typer.Argument(help="The service, e.g. http://127.0.0.1:8090.")],
    tokens: Annotated[
        str | None,
        typer.Option(help='Token ids of the request: "1 2 3 ..." (spaces or commas).'),
    ] = None,
    block_hashes: Annotated[
        str | None,
        typer.Option(help="Instead of --tokens: Dynamo local block hashes (signed i64)."),
    ] = None,
    model_name: Annotated[str, typer.Option(help="Model to query.")] = "default",
    lora_name: Annotated[str | None, typer.Option(help="LoRA adapter of the request.")] = None,
    route: Annotated[
        bool, typer.Option("--route", help="Ask for the router's decision (POST /route).")
    ] = False,
    token_file: Annotated[
        str | None, typer.Option(help="File holding the service's bearer token.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw JSON answer.")] = False,
) -> None:
    """Ask an index service which workers hold a request's prefix (POST /query)."""
    import json
    from pathlib import Path

    from kvstream.errors import ConfigError
    from kvstream.serve.client import Client
    from kvstream.serve.errors import ServiceError, UnavailableError

    def numbers(text: str, what: str) -> list[int]:
        try:
            return [int(t) for t in text.replace(",", " ").split()]
        except ValueError:
            typer.echo(f"error: {what} must be integers separated by spaces or commas", err=True)
            raise typer.Exit(2) from None

    if (tokens is None) == (block_hashes is None):
        typer.echo("error: give exactly one of --tokens and --block-hashes", err=True)
        raise typer.Exit(2)
    try:
        token = None if token_file is None else Path(token_file).read_text().strip()
        client = Client(url, token=token)
    except (OSError, ConfigError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    extra = {} if lora_name is None else {"lora_name": lora_name}
    try:
        with client:
            if block_hashes is not None:
                answer = client.query_by_hash(
                    numbers(block_hashes, "--block-hashes"), model_name=model_name, **extra
                )
            elif route:
                answer = client.route(
                    numbers(tokens or "", "--tokens"), model_name=model_name, **extra
                )
            else:
                answer = client.query(
                    numbers(tokens or "", "--tokens"), model_name=model_name, **extra
                )
    except UnavailableError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except ServiceError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2 if 400 <= exc.status < 500 else 1) from None
    if as_json:
        typer.echo(json.dumps(answer, indent=2))
        return
    if route:
        typer.echo(f"route to instance {answer['instance_id']} rank {answer['dp_rank']}")
        for s in answer["scores"]:
            typer.echo(
                f"  {s.get('worker', '?'):<24} matched {s.get('matched_blocks', 0):>5} blocks"
                f"  cost {s.get('cost', 0.0):.2f}"
            )
        return
    if not answer["scores"] and not answer["instances"]:
        typer.echo("no worker holds a prefix of this request")
        return
    typer.echo(f"{'instance':<22} {'rank':>4} {'GPU tokens':>10}")
    for inst, ranks in sorted(answer["scores"].items()):
        for rank, n in sorted(ranks.items(), key=lambda kv: int(kv[0])):
            typer.echo(f"{inst:<22} {rank:>4} {n:>10}")
    typer.echo("")
    typer.echo(f"{'instance':<22} {'longest':>8} {'GPU':>8} {'+host':>8} {'+disk':>8}")
    for inst, e in sorted(answer["instances"].items()):
        typer.echo(
            f"{inst:<22} {e['longest_matched']:>8} {e['gpu']:>8} {e['cpu']:>8} {e['disk']:>8}"
        )

"""``kvstream hash``: block hashes of a token sequence, as an engine or router computes them."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from kvstream.errors import HashingError, KVStreamError, UnknownHashAlgorithmError


def _params(pairs: list[str], seed: str | None) -> dict[str, Any]:
    """Algorithm parameters from ``KEY=VALUE`` strings (``true``/``false`` become booleans)."""
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--param")
        params[key] = {"true": True, "false": False}.get(value.lower(), value)
    if seed is not None:
        params["seed"] = seed
    return params


def _blocks(
    tokens: list[int], block_size: int, *, partial: bool, drop_last: bool
) -> list[list[int]]:
    """The token ids cut into blocks as :func:`kvstream.hashing.split_blocks` cuts them, but
    kept as Python ints: each algorithm checks the ids it can hash itself, exactly as
    ``get_hasher(algo).chain(blocks)`` does (SGLang's page hash takes ids up to 2**63-1, the
    algorithms that pack ids as uint32 refuse ids >= 2**32 with a HashingError)."""
    if drop_last:
        tokens = tokens[:-1]
    end = len(tokens) if partial else len(tokens) - len(tokens) % block_size
    return [tokens[i : i + block_size] for i in range(0, end, block_size)]


def hash_tokens(
    tokens: Annotated[list[int], typer.Argument(help="Token ids, e.g. 1 2 3 4 5 6.")],
    algo: Annotated[
        str,
        typer.Option("--algo", "-a", help="Hash algorithm; an unknown name lists the known ones."),
    ] = "v2_sha256",
    block_size: Annotated[
        int, typer.Option("--block-size", "-b", min=1, help="Tokens per block.")
    ] = 32,
    partial: Annotated[
        bool, typer.Option(help="Also hash the trailing partial block (TensorRT-LLM router).")
    ] = False,
    drop_last: Annotated[
        bool,
        typer.Option(help="Drop the last prompt token first (TensorRT-LLM router rule)."),
    ] = False,
    lora_id: Annotated[int | None, typer.Option(help="LoRA adapter id (TensorRT-LLM).")] = None,
    lora_name: Annotated[
        str | None, typer.Option(help="LoRA adapter name (vLLM, Dynamo, SGLang).")
    ] = None,
    lora_path: Annotated[
        str | None, typer.Option(help="LoRA adapter path (vLLM >= 0.31 hashes it).")
    ] = None,
    cache_salt: Annotated[str | None, typer.Option(help="Cache salt (tenant isolation).")] = None,
    extra_key: Annotated[
        str | None,
        typer.Option(help="SGLang extra_key (a LoRA request's ends with the adapter's lora_id)."),
    ] = None,
    seed: Annotated[
        str | None, typer.Option(help="vLLM NONE_HASH seed (PYTHONHASHSEED), vllm_* only.")
    ] = None,
    param: Annotated[
        list[str] | None,
        typer.Option(
            "--param",
            "-p",
            help="Algorithm parameter KEY=VALUE, repeatable: salt_hash=sha256, "
            "encoding=u64, extra_keys=legacy, event_format=dynamo...",
        ),
    ] = None,
    signed: Annotated[
        bool, typer.Option(help="Print 64-bit hashes signed (SGLang's event form).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Print the chained block hashes of TOKENS (one line per block: index, tokens, hash).

    Token ids are checked by the algorithm, as ``get_hasher(ALGO).chain`` checks them:
    ``sglang_sha256_64`` hashes ids up to 2**63-1 as SGLang does; every other algorithm packs
    ids as uint32 and refuses larger ones (exit 2).
    """
    from kvstream._types import hash_to_hex, hash_to_int
    from kvstream.hashing import get_hasher

    params = _params(param or [], seed)
    scope: dict[str, Any] = {"lora_id": lora_id, "cache_salt": cache_salt}
    for key, given in (("lora_name", lora_name), ("lora_path", lora_path)):
        if given is not None:
            scope[key] = given
    if extra_key is not None:
        scope["extra_key"] = extra_key
    try:
        hasher = get_hasher(algo, **params)
        blocks = _blocks(tokens, block_size, partial=partial, drop_last=drop_last)
        hashes = hasher.chain_bytes(blocks, **scope)
    except TypeError as exc:
        hint = " (--extra-key applies to sglang_sha256_64)" if "extra_key" in str(exc) else ""
        typer.echo(f"error: {exc}{hint}", err=True)
        raise typer.Exit(2) from None
    except HashingError as exc:
        where = "" if isinstance(exc, UnknownHashAlgorithmError) else f"{algo}: "
        typer.echo(f"error: {where}{exc}", err=True)
        raise typer.Exit(2) from None
    except (KVStreamError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    rows = [
        {
            "block": i,
            "tokens": len(block),
            "hex": hash_to_hex(h),
            **(
                {"int": int.from_bytes(h, "big", signed=signed) if signed else hash_to_int(h)}
                if len(h) == 8
                else {}
            ),
        }
        for i, (block, h) in enumerate(zip(blocks, hashes, strict=True))
    ]
    if as_json:
        typer.echo(json.dumps({"hash_algo": algo, "block_size": block_size, "blocks": rows}))
        return
    for r in rows:
        value = r.get("int", r["hex"])
        typer.echo(f"{r['block']:>4}  {r['tokens']:>4} tokens  {value}")

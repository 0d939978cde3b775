"""``kvstream hash``: block hashes of a token sequence, as an engine or router computes them."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from kvstream._types import hash_to_hex, hash_to_int
from kvstream.errors import KVStreamError


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
    lora_id: Annotated[int | None, typer.Option(help="LoRA adapter id.")] = None,
    cache_salt: Annotated[str | None, typer.Option(help="Cache salt (tenant isolation).")] = None,
    seed: Annotated[
        str | None, typer.Option(help="vLLM NONE_HASH seed (PYTHONHASHSEED), vllm_* only.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Print the chained block hashes of TOKENS (one line per block: index, tokens, hash)."""
    from kvstream.hashing import get_hasher, split_blocks

    params = {"seed": seed} if seed is not None else {}
    try:
        hasher = get_hasher(algo, **params)
        blocks = split_blocks(
            tokens, block_size, include_partial=partial, drop_last_token=drop_last
        )
        hashes = hasher.chain_bytes(blocks, lora_id=lora_id, cache_salt=cache_salt)
    except (KVStreamError, TypeError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    rows = [
        {
            "block": i,
            "tokens": len(block),
            "hex": hash_to_hex(h),
            **({"int": hash_to_int(h)} if len(h) == 8 else {}),
        }
        for i, (block, h) in enumerate(zip(blocks, hashes, strict=True))
    ]
    if as_json:
        typer.echo(json.dumps({"hash_algo": algo, "block_size": block_size, "blocks": rows}))
        return
    for r in rows:
        value = r.get("int", r["hex"])
        typer.echo(f"{r['block']:>4}  {r['tokens']:>4} tokens  {value}")

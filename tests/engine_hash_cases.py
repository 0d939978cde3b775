"""Reproduce one engine hash vector with kvstream (shared by the CI and peer hash tests).

A case is one entry of ``tests/data/peers/hash_vectors.json`` (written by
``scripts/peers/gen_hash_vectors.py`` from the engines' own code): ``algo``, algorithm
``params``, ``blocks`` (or ``"long"``: the document's long token set cut into ``block_size``
blocks), request ``scope``, optional per-block ``mm_keys`` and ``prompt_embeds``, and the
engine's hashes (``expect``: vLLM digests as hex, Dynamo ints; ``expect_signed``: SGLang's
signed int64 event values).
"""

from __future__ import annotations

from typing import Any

from kvstream.hashing import BlockHasher, get_hasher

M64 = 2**64 - 1


def case_blocks(case: dict[str, Any], token_sets: dict[str, list[int]]) -> list[list[int]]:
    """The case's blocks, with a named token set cut into ``block_size`` blocks."""
    blocks = case["blocks"]
    if isinstance(blocks, str):
        tokens, bs = token_sets[blocks], case["block_size"]
        return [tokens[i : i + bs] for i in range(0, len(tokens) - bs + 1, bs)]
    return [list(b) for b in blocks]


def case_kwargs(case: dict[str, Any]) -> dict[str, Any]:
    """The ``chain()`` keyword arguments of a case (scope and per-block extras)."""
    kwargs: dict[str, Any] = dict(case.get("scope", {}))
    if "mm_keys" in case:
        kwargs["mm_keys"] = [[tuple(k) for k in keys] for keys in case["mm_keys"]]
    if "prompt_embeds" in case:
        kwargs["prompt_embeds"] = [bytes.fromhex(d) for d in case["prompt_embeds"]]
    return kwargs


def fold(h: BlockHasher, blocks: list[list[int]], kwargs: dict[str, Any]) -> list[bytes]:
    """The chain through ``root()`` + ``extend()``, one block at a time."""
    scope = {k: v for k, v in kwargs.items() if k not in ("mm_keys", "prompt_embeds")}
    state = h.root(**scope)
    out = []
    for i, block in enumerate(blocks):
        extra: dict[str, Any] = {}
        if "prompt_embeds" in kwargs:
            extra["prompt_embeds"] = kwargs["prompt_embeds"][i]
        mm = kwargs["mm_keys"][i] if "mm_keys" in kwargs else ()
        published, state = h.extend(state, block, mm, **extra)
        out.append(published)
    return out


def reproduce(
    case: dict[str, Any], token_sets: dict[str, list[int]]
) -> list[tuple[str, list[Any], list[Any]]]:
    """``(hasher name, engine values, kvstream values)`` for every name the case pins.

    vLLM cases pin the digest algorithm and its ``_64`` form (the digest's last 8 bytes, as
    vLLM's ``maybe_convert_block_hash``); SGLang cases compare the signed int64 event values;
    every comparison covers ``chain_bytes`` and the ``root``/``extend`` fold.
    """
    blocks = case_blocks(case, token_sets)
    kwargs = case_kwargs(case)
    params = case.get("params", {})
    out: list[tuple[str, list[Any], list[Any]]] = []
    algo = case["algo"]
    if algo.startswith("vllm"):
        digests = [bytes.fromhex(d) for d in case["expect"]]
        for name, want in (
            (algo, [d.hex() for d in digests]),
            (algo + "_64", [int.from_bytes(d, "big") & M64 for d in digests]),
        ):
            h = get_hasher(name, **params)
            got = h.chain(blocks, **kwargs)
            folded = fold(h, blocks, kwargs)
            if h.width == 32:
                out.append((name, want, [g.hex() for g in got]))  # type: ignore[union-attr]
                out.append((name + " (fold)", want, [g.hex() for g in folded]))
            else:
                out.append((name, want, got))
                out.append((name + " (fold)", want, [int.from_bytes(g, "big") for g in folded]))
        return out
    h = get_hasher(algo, **params)
    if "expect_signed" in case:
        want = case["expect_signed"]
        conv = [int.from_bytes(b, "big", signed=True) for b in h.chain_bytes(blocks, **kwargs)]
        out.append((algo, want, conv))
        folded = [int.from_bytes(b, "big", signed=True) for b in fold(h, blocks, kwargs)]
        out.append((algo + " (fold)", want, folded))
        return out
    want = case["expect"]
    out.append((algo, want, h.chain(blocks, **kwargs)))
    out.append(
        (algo + " (fold)", want, [int.from_bytes(b, "big") for b in fold(h, blocks, kwargs)])
    )
    return out

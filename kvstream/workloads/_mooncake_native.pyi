"""Type stub of the optional C extension ``kvstream.workloads._mooncake_native``
(``_mooncake_native.c``): a Mooncake hash-id row's prompt bytes in one call (see
:meth:`kvstream.workloads.mooncake.MooncakeTokens.prompt`, the reference and fallback)."""

from collections.abc import Sequence

from typing_extensions import Buffer

def prompt(
    pool: Buffer,
    hash_ids: Sequence[int],
    seed: int,
    vocab_size: int,
    block_tokens: int,
    n_tokens: int,
    /,
) -> bytes | None: ...

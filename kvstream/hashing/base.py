"""The :class:`BlockHasher` interface, its chain state, and the request-scope helpers.

A hasher turns a request's token blocks into a chain of block hashes: block *i*'s hash
depends on block *i-1*'s (its parent) and, at the root, on the request's scope (LoRA adapter,
cache salt). Two ways to drive it, always giving the same values:

- ``chain_bytes(blocks, ...)`` / ``chain(blocks, ...)``: a whole request at once (routers);
- ``root(...)`` then ``extend(state, block)`` per block (cache managers committing blocks one
  at a time). The state is an immutable :class:`ChainState`, so a prefix's state can be kept
  and extended along several branches.

An algorithm implements :meth:`BlockHasher.root` and :meth:`BlockHasher.extend`; the base class
validates a chain call's per-block arguments (rejecting the inputs the algorithm declares it
does not hash) and folds ``extend`` over the blocks. An algorithm with a faster whole-request
loop overrides only :meth:`BlockHasher._chain`, which receives the validated arguments; for
packed requests (:meth:`BlockHasher.chain_raw`) it names its C chain (``_c``, ``_c_kind``,
``_c_args``) or overrides :meth:`BlockHasher._chain_raw`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, NamedTuple, TypeAlias

from kvstream._types import TokenIds
from kvstream.errors import HashingError
from kvstream.hashing.salt import cache_salt_id

__all__ = [
    "BlockHasher",
    "ChainState",
    "PerBlock",
    "cache_salt_id",
    "check_str",
    "check_u64",
    "id_scope",
    "name_scope",
    "per_block_args",
    "resolve_salt_id",
    "scope_bytes",
]

_U64_MAX = 2**64 - 1
_tuple_new = tuple.__new__

#: A chain call's per-block input after validation: one entry per block, or None when the
#: call gave none (see :func:`per_block_args`).
PerBlock: TypeAlias = list[Any] | None


class ChainState(NamedTuple):
    """Immutable chain position: treat as opaque and pass back to the hasher that made it.

    ``algo`` is the hasher's name, ``key`` the chaining value after the last block (the root
    key at the root), ``depth`` the number of blocks hashed so far, and ``scope`` the
    algorithm's per-request inputs that apply beyond the root.
    """

    algo: str
    key: Any
    depth: int
    scope: tuple[Any, ...]


def check_u64(name: str, value: object) -> int:
    """``value`` as an unsigned 64-bit int; HashingError if it is not an int in 0..2**64-1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise HashingError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= _U64_MAX:
        raise HashingError(f"{name} must be in 0..2**64-1, got {value}")
    return value


def check_str(name: str, value: object) -> None:
    """HashingError unless ``value`` is None or a str."""
    if value is not None and not isinstance(value, str):
        raise HashingError(f"{name} must be a str, got {type(value).__name__}")


def resolve_salt_id(cache_salt: str | None, salt_id: int | None, *, salt_hash: str) -> int | None:
    """The numeric salt of a request: ``salt_id``, or ``cache_salt`` mapped by ``salt_hash``.

    ``salt_hash`` names the string -> id derivation (:func:`~kvstream.hashing.salt.cache_salt_id`).
    Passing both ``cache_salt`` and ``salt_id`` is ambiguous and raises HashingError.
    """
    if cache_salt is not None and salt_id is not None:
        raise HashingError("pass either cache_salt or salt_id, not both")
    if cache_salt is not None:
        return cache_salt_id(cache_salt, salt_hash)
    if salt_id is not None:
        return check_u64("salt_id", salt_id)
    return None


def id_scope(
    name: str, lora_id: Any, cache_salt: Any, salt_id: Any, lora_name: Any, *, salt_hash: str
) -> tuple[int | None, int | None]:
    """(lora_id, salt_id) of a request for the id-scoped algorithms (TensorRT-LLM, blake3)."""
    if lora_id is None and lora_name is not None:
        raise HashingError(
            f"{name} identifies LoRA adapters by lora_id; got lora_name={lora_name!r} "
            "without a lora_id"
        )
    lora = None if lora_id is None else check_u64("lora_id", lora_id)
    return lora, resolve_salt_id(cache_salt, salt_id, salt_hash=salt_hash)


def name_scope(
    name: str, lora_id: Any, cache_salt: Any, salt_id: Any, lora_name: Any, *, no_salt_id: str
) -> None:
    """Check a request scope for the name-scoped algorithms (vLLM, Dynamo).

    They hash the ``cache_salt`` string and identify LoRA adapters by ``lora_name``: a
    ``salt_id`` raises HashingError with ``no_salt_id`` (the algorithm's reason), as do a
    ``lora_id`` without a ``lora_name`` and a salt or name that is not a str.
    """
    if salt_id is not None:
        raise HashingError(
            no_salt_id
            + (" (and pass either cache_salt or salt_id, not both)" if cache_salt else "")
        )
    check_str("cache_salt", cache_salt)
    if lora_name is None and lora_id is not None:
        raise HashingError(
            f"{name} identifies LoRA adapters by lora_name; got lora_id={lora_id!r} "
            "without a lora_name"
        )
    check_str("lora_name", lora_name)


def scope_bytes(lora_id: int | None, salt_id: int | None) -> bytes:
    """The V2 scope encoding: mask byte, then lora id and salt id (present ones) as u64 LE."""
    mask = (1 if lora_id is not None else 0) | (2 if salt_id is not None else 0)
    out = bytes([mask])
    if lora_id is not None:
        out += lora_id.to_bytes(8, "little")
    if salt_id is not None:
        out += salt_id.to_bytes(8, "little")
    return out


class BlockHasher(ABC):
    """One block-hash algorithm, bound to its algorithm-level parameters. Immutable.

    Attributes: ``name`` (the ``hash_algo`` name events publish) and ``width`` (bytes of a
    published hash: 8 for 64-bit algorithms, 32 for 256-bit ones).
    """

    name: str
    width: int
    #: Why the algorithm rejects per-token extra ids (None: it hashes them). Chain calls raise
    #: HashingError with it for any block given some; ``extend`` implementations raise it too.
    _no_extra_ids: ClassVar[str | None] = None
    #: Likewise for multimodal keys.
    _no_mm_keys: ClassVar[str | None] = None
    #: The C module (:mod:`kvstream.hashing._chainnative`) hashing this hasher's packed
    #: requests in :meth:`chain_raw`, None for none; set per instance
    #: (:func:`kvstream.hashing.accel.native_chains`).
    _c: Any = None
    #: Its chain kind for this algorithm (``accel.KIND_*``); used only with :attr:`_c`.
    _c_kind: ClassVar[int] = -1
    #: Whether :attr:`_c` hashes several requests' chains of this kind side by side
    #: (``_chainnative.chain_many``, for :meth:`chain_raw_many`).
    _c_many: ClassVar[bool] = False

    @abstractmethod
    def root(
        self,
        lora_id: int | None = None,
        cache_salt: str | None = None,
        salt_id: int | None = None,
        lora_name: str | None = None,
        *,
        lora_path: str | None = None,
    ) -> ChainState:
        """The chain state before a request's first block.

        ``lora_id``/``lora_name``(+``lora_path``) name the LoRA adapter, ``cache_salt`` (a
        string) or ``salt_id`` (an int) the cache-isolation salt; which of them an algorithm
        hashes is in its docs. Passing an adapter or salt in a form the algorithm cannot
        hash raises HashingError rather than silently hashing without it.
        """

    @abstractmethod
    def extend(
        self,
        state: ChainState,
        block_tokens: Any,
        mm_keys: Iterable[Any] | None = (),
        token_extra_ids: Any = None,
    ) -> tuple[bytes, ChainState]:
        """Hash one block after ``state``: ``(published hash of width self.width, new state)``.

        ``mm_keys`` are the block's multimodal keys (see :mod:`kvstream.hashing.multimodal`);
        ``token_extra_ids`` one extra id per token (algorithms that define them). The states
        are never mutated.
        """

    def _check_state(self, state: ChainState) -> None:
        """Raise HashingError unless ``state`` is a chain state of this algorithm."""
        if type(state) is not ChainState or state.algo != self.name:
            got = state.algo if isinstance(state, ChainState) else type(state).__name__
            raise HashingError(f"{self.name}.extend() got a chain state of {got}")

    def chain_bytes(
        self,
        blocks: Iterable[Any],
        lora_id: int | None = None,
        cache_salt: str | None = None,
        salt_id: int | None = None,
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        mm_keys: Sequence[Iterable[Any] | None] | None = None,
        token_extra_ids: Sequence[Any] | None = None,
        **scope: Any,
    ) -> list[bytes]:
        """The published hash of every block, as bytes of width ``self.width``.

        64-bit values are big-endian. ``mm_keys`` and ``token_extra_ids``, when given, hold
        one entry per block (None or empty for a block without any). ``scope`` holds the
        algorithm's own request-scope keywords of :meth:`root` (SGLang's ``extra_key``).
        Equals folding :meth:`extend` over the blocks from :meth:`root`.
        """
        blocks = list(blocks)
        mm, extra = self._block_args(len(blocks), mm_keys, token_extra_ids)
        state = self.root(lora_id, cache_salt, salt_id, lora_name, lora_path=lora_path, **scope)
        return self._chain(state, blocks, mm, extra)

    def chain(
        self,
        blocks: Iterable[Any],
        lora_id: int | None = None,
        cache_salt: str | None = None,
        salt_id: int | None = None,
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        mm_keys: Sequence[Iterable[Any] | None] | None = None,
        token_extra_ids: Sequence[Any] | None = None,
        **scope: Any,
    ) -> list[int] | list[bytes]:
        """Like :meth:`chain_bytes`, in the form engines publish in JSON.

        Unsigned ints for 64-bit algorithms, 32-byte ``bytes`` for 256-bit ones.
        """
        out = self.chain_bytes(
            blocks,
            lora_id,
            cache_salt,
            salt_id,
            lora_name=lora_name,
            lora_path=lora_path,
            mm_keys=mm_keys,
            token_extra_ids=token_extra_ids,
            **scope,
        )
        if self.width == 8:
            return [int.from_bytes(b, "big") for b in out]
        return out

    def _block_args(
        self,
        n_blocks: int,
        mm_keys: Sequence[Iterable[Any] | None] | None,
        token_extra_ids: Sequence[Any] | None,
    ) -> tuple[PerBlock, PerBlock]:
        """A chain call's per-block ``(mm_keys, token_extra_ids)`` lists, validated.

        One entry per block (see :func:`per_block_args`); HashingError for a block with an
        input the algorithm does not hash (:attr:`_no_extra_ids`, :attr:`_no_mm_keys`).
        """
        mm, extra = per_block_args(n_blocks, mm_keys, token_extra_ids)
        reason = self._no_extra_ids
        if reason is not None and extra is not None and any(e is not None for e in extra):
            raise HashingError(reason)
        reason = self._no_mm_keys
        if reason is not None and mm is not None and any(mm):
            raise HashingError(reason)
        return mm, extra

    def _chain(
        self, state: ChainState, blocks: list[Any], mm: PerBlock, extra: PerBlock
    ) -> list[bytes]:
        """Hook: the published hashes of ``blocks`` after the root ``state``.

        ``mm`` and ``extra`` come from :meth:`_block_args` (None: no block has any). This
        default folds :meth:`extend`; algorithms override it with a faster loop.
        """
        out: list[bytes] = []
        for i, block in enumerate(blocks):
            published, state = self.extend(
                state,
                block,
                mm[i] if mm is not None else (),
                extra[i] if extra is not None else None,
            )
            out.append(published)
        return out

    def chain_raw(
        self,
        state: ChainState,
        raw: bytes,
        tokens_per_block: int,
        *,
        start: int = 0,
        every: int = 0,
    ) -> tuple[list[bytes], list[Any]]:
        """The published hashes of a packed request's full blocks, from block ``start`` on.

        ``raw`` holds the request's token ids as u32 little-endian bytes; block ``i`` is ids
        ``i * tokens_per_block`` up to the next block (a trailing partial block is not hashed).
        ``state`` is the chain state before block ``start`` (the root for 0; see
        :meth:`resume`). Also returns the chain keys (``ChainState.key``) after every block
        ``i >= start`` with ``(i + 1) % every == 0`` (none when ``every`` is 0), the points a
        caller can resume from. Equals :meth:`chain_bytes` over the same blocks (no mm keys, no
        extra ids).

        Runs in one C call when the hasher has a C chain (:attr:`_c`, of kind :attr:`_c_kind`,
        its arguments from :meth:`_c_args`), else :meth:`_chain_raw`.
        """
        c = self._c
        if c is None:
            return self._chain_raw(state, raw, tokens_per_block, start, every)
        if type(state) is not ChainState or state.algo != self.name:
            self._check_state(state)
        args = self._c_args(state, tokens_per_block)
        if args is None:
            return self._chain_raw(state, raw, tokens_per_block, start, every)
        parent, offset, first, tail = args
        kind, width = self._c_kind, self.width
        out: tuple[list[bytes], list[Any]] = c.chain(
            kind, raw, tokens_per_block, parent, start, width, offset, first, tail, every
        )
        return out

    def chain_raw_many(
        self, state: ChainState, raws: Sequence[bytes], tokens_per_block: int
    ) -> list[tuple[list[bytes], list[Any]]]:
        """:meth:`chain_raw` of several packed requests with the same root ``state``, each
        returning its last chain key: equal to ``[chain_raw(state, raw, tokens_per_block,
        every=n) for raw in raws]`` with ``n`` the full blocks of that ``raw`` (``([], [])``
        for a request without a full block). HashingError for a state of another algorithm or
        ``tokens_per_block < 1``.

        The requests' chains are independent, so they may be hashed side by side: in one C
        call when the hasher's C chain has a lane implementation for its kind
        (:attr:`_c_many`; BLAKE3: eight requests a step on AVX2), else one after the other.
        """
        if type(state) is not ChainState or state.algo != self.name:
            self._check_state(state)
        if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int):
            raise HashingError(
                f"tokens_per_block must be an int, got {type(tokens_per_block).__name__}"
            )
        if tokens_per_block < 1:
            raise HashingError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        c = self._c
        if c is not None and self._c_many:
            args = self._c_args(state, tokens_per_block)
            if args is not None and args[2] is None and args[3] is None:
                out: list[tuple[list[bytes], list[Any]]] = c.chain_many(
                    self._c_kind, raws, tokens_per_block, args[0], self.width, args[1]
                )
                return out
        step = 4 * tokens_per_block
        return [
            self.chain_raw(state, raw, tokens_per_block, every=len(raw) // step)
            if len(raw) >= step
            else ([], [])
            for raw in raws
        ]

    def _c_args(
        self, state: ChainState, tokens_per_block: int
    ) -> tuple[bytes, int, bytes | None, bytes | None] | None:
        """Hook of the C chain (:meth:`chain_raw`): the parent key of the block after
        ``state``, where the published bytes start in a 32-byte key, and the chain kind's
        ``first_tail`` and ``tail`` (None: the kind's default; see ``_chainnative.chain``);
        None when the C chain does not cover these blocks (then :meth:`_chain_raw`)."""
        return state.key, 0, None, None

    def _chain_raw(
        self, state: ChainState, raw: bytes, tokens_per_block: int, start: int, every: int
    ) -> tuple[list[bytes], list[Any]]:
        """Hook: :meth:`chain_raw` without the C chain. This default slices the blocks and
        folds :meth:`extend`; algorithms with a faster whole-request loop override it."""
        step = 4 * tokens_per_block
        blocks = [
            TokenIds.from_bytes(raw[i * step : (i + 1) * step])
            for i in range(start, len(raw) // step)
        ]
        if every <= 0:
            return self._chain(state, blocks, None, None), []
        out: list[bytes] = []
        keys: list[Any] = []
        extend = self.extend
        for i, block in enumerate(blocks, start + 1):
            published, state = extend(state, block)
            out.append(published)
            if i % every == 0:
                keys.append(state.key)
        return out, keys

    def resume(self, root: ChainState, key: Any, depth: int) -> ChainState:
        """The chain state after ``depth`` blocks of a request whose root is ``root``, the
        last of them with chain key ``key`` (a key :meth:`chain_raw` returned)."""
        if type(root) is not ChainState or root.algo != self.name:
            self._check_state(root)
        # tuple.__new__, not _replace: a cache calls this per prompt and per appended output
        return _tuple_new(ChainState, (root.algo, key, depth, root.scope))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} width={self.width}>"


def per_block_args(
    n_blocks: int,
    mm_keys: Sequence[Iterable[Any] | None] | None,
    token_extra_ids: Sequence[Any] | None,
) -> tuple[PerBlock, PerBlock]:
    """Validate the per-block ``mm_keys``/``token_extra_ids`` of a chain call (one per block)."""
    mm = None
    if mm_keys is not None:
        mm = list(mm_keys)
        if len(mm) != n_blocks:
            raise HashingError(
                f"mm_keys needs one entry per block: got {len(mm)} for {n_blocks} blocks"
            )
    extra = None
    if token_extra_ids is not None:
        extra = list(token_extra_ids)
        if len(extra) != n_blocks:
            raise HashingError(
                f"token_extra_ids needs one entry per block: got {len(extra)} for {n_blocks} blocks"
            )
    return mm, extra

"""The :class:`BlockHasher` interface, its chain state, and the request-scope helpers.

A hasher turns a request's token blocks into a chain of block hashes: block *i*'s hash
depends on block *i-1*'s (its parent) and, at the root, on the request's scope (LoRA adapter,
cache salt). Two ways to drive it, always giving the same values:

- ``chain_bytes(blocks, scope)`` / ``chain(blocks, scope)``: a whole request at once (routers);
- ``root(scope)`` then ``extend(state, block)`` per block (cache managers committing blocks one
  at a time). The state is an immutable :class:`ChainState`, so a prefix's state can be kept
  and extended along several branches.

The request scope is one :class:`~kvstream.hashing.scope.HashScope`; the public methods also
take its fields as keywords (``cache_salt="t"``) or, as they always have, the first four
positionally (see :meth:`~kvstream.hashing.scope.HashScope.of`).

An algorithm implements :meth:`BlockHasher._root` (the root state of a scope) and
:meth:`BlockHasher.extend`; the base class turns a call's arguments into a scope, validates its
per-block arguments (rejecting the inputs the algorithm declares it does not hash) and folds
``extend`` over the blocks. An algorithm with a faster whole-request
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
from kvstream.hashing.scope import EMPTY_SCOPE, HashScope

__all__ = [
    "BlockHasher",
    "ChainState",
    "HashScope",
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


def id_scope(name: str, scope: HashScope, *, salt_hash: str) -> tuple[int | None, int | None]:
    """(lora_id, salt_id) of a request for the id-scoped algorithms (TensorRT-LLM, blake3)."""
    lora_id, lora_name = scope.lora_id, scope.lora_name
    if lora_id is None and lora_name is not None:
        raise HashingError(
            f"{name} identifies LoRA adapters by lora_id; got lora_name={lora_name!r} "
            "without a lora_id"
        )
    lora = None if lora_id is None else check_u64("lora_id", lora_id)
    return lora, resolve_salt_id(scope.cache_salt, scope.salt_id, salt_hash=salt_hash)


def name_scope(name: str, scope: HashScope, *, no_salt_id: str) -> None:
    """Check a request scope for the name-scoped algorithms (vLLM, Dynamo).

    They hash the ``cache_salt`` string and identify LoRA adapters by ``lora_name``: a
    ``salt_id`` raises HashingError with ``no_salt_id`` (the algorithm's reason), as do a
    ``lora_id`` without a ``lora_name`` and a salt or name that is not a str.
    """
    lora_id, cache_salt, lora_name = scope.lora_id, scope.cache_salt, scope.lora_name
    if scope.salt_id is not None:
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


_NOT_MEMOISED: Any = object()


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
    #: Whether the algorithm hashes :attr:`HashScope.extra_key` (SGLang's).
    _takes_extra_key: ClassVar[bool] = False
    #: The C module (:mod:`kvstream.hashing._chainnative`) hashing this hasher's packed
    #: requests in :meth:`chain_raw`, None for none; set per instance
    #: (:func:`kvstream.hashing.accel.native_chains`).
    _c: Any = None
    #: Its chain kind for this algorithm (``accel.KIND_*``); used only with :attr:`_c`.
    _c_kind: ClassVar[int] = -1
    #: Whether :attr:`_c` hashes several requests' chains of this kind side by side
    #: (``_chainnative.chain_many``, for :meth:`chain_raw_many`).
    _c_many: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A hasher written before HashScope overrides root(lora_id, cache_salt, ...) instead
        # of _root(scope): its root is adapted, so registered third-party hashers keep working.
        legacy = cls.__dict__.get("root")
        if legacy is not None and "_root" not in cls.__dict__:

            def _root(self: BlockHasher, scope: HashScope) -> ChainState:
                state: ChainState = legacy(self, **scope.given())
                return state

            cls._root = _root  # type: ignore[method-assign]

    def root(self, *args: Any, scope: HashScope | None = None, **fields: Any) -> ChainState:
        """The chain state before the first block of a request with this scope.

        The scope is a :class:`HashScope` (positionally or as ``scope=``), or its fields as
        keywords, or ``lora_id, cache_salt, salt_id, lora_name`` positionally (see
        :meth:`HashScope.of`; TypeError for arguments it does not take). Which fields an
        algorithm hashes is in its docs: a LoRA adapter or salt in a form the algorithm cannot
        hash raises HashingError rather than silently hashing without it.
        """
        if scope is None and not fields and len(args) <= 4 and args.count(None) == len(args):
            # the common unscoped request: a hasher is immutable, so its root is computed once
            root: ChainState | None = self.__dict__.get("_unscoped_root")
            if root is None:
                root = self.__dict__["_unscoped_root"] = self._root(EMPTY_SCOPE)
            return root
        return self._root(self._scope(scope, args, fields))

    def _scope(
        self, scope: HashScope | None, args: tuple[Any, ...], fields: dict[str, Any]
    ) -> HashScope:
        """The call's :class:`HashScope`; TypeError for an ``extra_key`` given to an algorithm
        without one (as the keyword was refused before scopes were values)."""
        out = HashScope.of(scope, args, fields)
        if out.extra_key is not None and not self._takes_extra_key:
            raise TypeError(f"{self.name} takes no extra_key (SGLang's request scope)")
        return out

    @abstractmethod
    def _root(self, scope: HashScope) -> ChainState:
        """Hook: the root state of ``scope`` (what :meth:`root` returns)."""

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
        *args: Any,
        scope: HashScope | None = None,
        mm_keys: Sequence[Iterable[Any] | None] | None = None,
        token_extra_ids: Sequence[Any] | None = None,
        prompt_embeds: Sequence[bytes | None] | None = None,
        **fields: Any,
    ) -> list[bytes]:
        """The published hash of every block, as bytes of width ``self.width``.

        The request's scope is given as to :meth:`root` (``args``, ``scope`` or ``fields``).
        64-bit values are big-endian. ``mm_keys``, ``token_extra_ids`` and ``prompt_embeds``
        (vLLM only: each block's prompt-embeddings digest; TypeError for another algorithm),
        when given, hold one entry per block (None or empty for a block without any).
        Equals folding :meth:`extend` over the blocks from :meth:`root`.
        """
        state, blocks, mm, extra = self._request(
            blocks, args, scope, mm_keys, token_extra_ids, fields
        )
        if prompt_embeds is not None:
            return self._chain_embeds(state, blocks, mm, extra, prompt_embeds)
        return self._chain(state, blocks, mm, extra)

    def chain(
        self,
        blocks: Iterable[Any],
        *args: Any,
        scope: HashScope | None = None,
        mm_keys: Sequence[Iterable[Any] | None] | None = None,
        token_extra_ids: Sequence[Any] | None = None,
        prompt_embeds: Sequence[bytes | None] | None = None,
        **fields: Any,
    ) -> list[int] | list[bytes]:
        """Like :meth:`chain_bytes`, in the form engines publish in JSON.

        Unsigned ints for 64-bit algorithms, 32-byte ``bytes`` for 256-bit ones.
        """
        state, blocks, mm, extra = self._request(
            blocks, args, scope, mm_keys, token_extra_ids, fields
        )
        if prompt_embeds is None:
            return self._chain_json(state, blocks, mm, extra)
        out = self._chain_embeds(state, blocks, mm, extra, prompt_embeds)
        if self.width == 8:
            return [int.from_bytes(b, "big") for b in out]
        return out

    def _request(  # noqa: PLR0917 (a private helper of the two chain calls)
        self,
        blocks: Iterable[Any],
        args: tuple[Any, ...],
        scope: HashScope | None,
        mm_keys: Sequence[Iterable[Any] | None] | None,
        token_extra_ids: Sequence[Any] | None,
        fields: dict[str, Any],
    ) -> tuple[ChainState, list[Any], PerBlock, PerBlock]:
        """A chain call's root state, blocks and validated per-block arguments."""
        hash_scope = self._scope(scope, args, fields)
        block_list = list(blocks)
        mm, extra = self._block_args(len(block_list), mm_keys, token_extra_ids)
        return self._root(hash_scope), block_list, mm, extra

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

    def _chain_json(
        self, state: ChainState, blocks: list[Any], mm: PerBlock, extra: PerBlock
    ) -> list[int] | list[bytes]:
        """Hook: :meth:`_chain` in the JSON form of :meth:`chain`. This default converts
        :meth:`_chain`'s bytes; an algorithm that computes ints overrides it."""
        out = self._chain(state, blocks, mm, extra)
        if self.width == 8:
            return [int.from_bytes(b, "big") for b in out]
        return out

    def _chain_embeds(
        self,
        state: ChainState,
        blocks: list[Any],
        mm: PerBlock,
        extra: PerBlock,
        prompt_embeds: Sequence[bytes | None],
    ) -> list[bytes]:
        """Hook: :meth:`_chain` with one prompt-embeddings digest per block. Only algorithms
        that hash prompt embeddings (vLLM) override it; this default raises TypeError."""
        raise TypeError(f"{self.name} takes no prompt_embeds (vLLM's algorithms hash them)")

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
        args = self._c_chain_args(state, tokens_per_block)
        if args is None:
            return self._chain_raw(state, raw, tokens_per_block, start, every)
        parent, offset, first, tail = args
        kind, width = self._c_kind, self.width
        out: tuple[list[bytes], list[Any]] = c.chain(
            kind, raw, tokens_per_block, parent, start, width, offset, first, tail, every
        )
        return out

    def _c_chain_args(self, state: ChainState, tokens_per_block: int) -> Any:
        """:meth:`_c_args` of ``state`` (checked to be this hasher's), memoised for the
        unscoped root. Only for a hasher with a C chain."""
        if type(state) is not ChainState or state.algo != self.name:
            self._check_state(state)
        if state is self.__dict__.get("_unscoped_root"):  # its C arguments, computed once
            memo = self.__dict__.setdefault("_unscoped_c_args", {})
            args = memo.get(tokens_per_block, _NOT_MEMOISED)
            if args is _NOT_MEMOISED:
                args = memo[tokens_per_block] = self._c_args(state, tokens_per_block)
            return args
        return self._c_args(state, tokens_per_block)

    def _chain_ints(
        self, state: ChainState, tokens: Any, tokens_per_block: int, drop_last_token: bool
    ) -> tuple[bytes, list[bytes]] | None:
        """``(raw, chain_raw(state, raw, tokens_per_block)[0])`` with ``raw`` =
        ``pack_request(tokens, drop_last_token)``, packing and hashing in one C pass; None
        (nothing raised) when that pass does not apply: no C chain, ``tokens`` not a list or
        tuple of ints in ``0 .. 2**32 - 1``, or a state the C chain does not take. The caller
        then takes the two-step path, which raises the right error for bad input."""
        c = self._c
        if c is None or (type(tokens) is not list and type(tokens) is not tuple):
            return None
        args = self._c_chain_args(state, tokens_per_block)
        if args is None:
            return None
        parent, offset, first, tail = args
        got = c.chain_ints(
            self._c_kind,
            tokens,
            tokens_per_block,
            parent,
            0,
            self.width,
            offset,
            first,
            tail,
            0,
            drop_last_token,
        )
        if got is None:
            return None
        raw, (published, _) = got
        return raw, published

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

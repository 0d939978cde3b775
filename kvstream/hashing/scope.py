""":class:`HashScope`: the request-level inputs a block-hash chain is rooted in.

Every algorithm roots a request's chain in the same kind of inputs: the LoRA adapter
(``lora_id``, ``lora_name``, ``lora_path``), the cache-isolation salt (``cache_salt`` or
``salt_id``) and SGLang's ``extra_key``. They travel as one immutable :class:`HashScope`;
hashers implement ``BlockHasher._root(scope)``, and which fields an algorithm hashes (and which
it refuses with HashingError) is in its docs.

The public entry points (``root``, ``chain``, ``chain_bytes``) take a scope, or its fields as
keywords, or the first four positionally in the historical order ``lora_id, cache_salt,
salt_id, lora_name``: :meth:`HashScope.of` turns any of these forms into one value.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Final

__all__ = ["EMPTY_SCOPE", "HashScope"]

#: The fields the historical positional form names, in its order.
_POSITIONAL: Final = ("lora_id", "cache_salt", "salt_id", "lora_name")


@dataclass(frozen=True, slots=True)
class HashScope:
    """A request's hash scope. All fields default to None (no adapter, no salt).

    - ``lora_id``: the adapter's id: an int for TensorRT-LLM and BLAKE3, SGLang's
      ``LoRARef.lora_id`` string for SGLang;
    - ``lora_name`` (and ``lora_path``, which vLLM >= 0.31 hashes): the adapter by name, for
      vLLM and Dynamo;
    - ``cache_salt`` (a string) or ``salt_id`` (an int, the salt already mapped): the salt;
    - ``extra_key``: SGLang's request ``extra_key``.
    """

    lora_id: int | str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    salt_id: int | None = None
    extra_key: str | None = None

    @classmethod
    def of(
        cls, scope: HashScope | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> HashScope:
        """The scope a call names: ``scope``, or a scope given as the only positional
        argument, or the historical positional fields (``args``) and field keywords.

        TypeError, as for any call with arguments it does not take, for an unknown keyword,
        more than four positional fields, a field given twice, or a scope given together
        with fields.
        """
        if scope is None:
            if len(args) == 1 and isinstance(args[0], HashScope):
                scope, args = args[0], ()
            else:
                if len(args) > len(_POSITIONAL):
                    raise TypeError(
                        f"at most {len(_POSITIONAL)} positional scope fields "
                        f"({', '.join(_POSITIONAL)}), got {len(args)}"
                    )
                for name, value in zip(_POSITIONAL, args, strict=False):
                    if name in kwargs:
                        raise TypeError(f"got multiple values for argument {name!r}")
                    kwargs[name] = value
                for value in kwargs.values():
                    if value is not None:
                        return cls(**kwargs)  # TypeError for a name that is not a field
                if kwargs.keys() <= _FIELDS:
                    # the common request without adapter or salt: no value built
                    return EMPTY_SCOPE
                return cls(**kwargs)
        elif args and isinstance(args[0], HashScope):
            raise TypeError("got a HashScope twice (positionally and as scope=)")
        if args or kwargs:
            raise TypeError(
                "pass either a HashScope or its fields, not both (got a scope and "
                f"{', '.join([*_POSITIONAL[: len(args)], *kwargs])})"
            )
        if not isinstance(scope, HashScope):
            raise TypeError(f"scope must be a HashScope, got {type(scope).__name__}")
        return scope

    def given(self) -> dict[str, Any]:
        """The fields that are set (not None), as keywords."""
        return {f: getattr(self, f) for f in _FIELD_ORDER if getattr(self, f) is not None}


_FIELD_ORDER: Final = tuple(f.name for f in fields(HashScope))
_FIELDS: Final = frozenset(_FIELD_ORDER)

#: The scope of a request without adapter, salt or extra key.
EMPTY_SCOPE: Final = HashScope()

"""Immutable result records: the base of :class:`~kvstream.index.matching.WorkerMatch`,
:class:`~kvstream.index.matching.MatchResult`, :class:`~kvstream.index.router.WorkerScore` and
:class:`~kvstream.index.router.RouteDecision`.

A subclass declares its fields as annotations (defaults last), ``__slots__ = ()``, and may add
properties and methods::

    class Hit(Record):
        __slots__ = ()
        worker: WorkerKey
        blocks: int = 0

It then behaves as a frozen dataclass: ``Hit(key, 3)`` or ``Hit(worker=key)``; read-only
fields (assigning one raises :class:`dataclasses.FrozenInstanceError`); equal when of the same
class with equal values; ``hash`` of the values' tuple; ``Hit(worker=..., blocks=3)`` as its
repr; pickles and copies as a call of its class; ``__match_args__`` for ``match`` statements.

The values live in the record itself. With the native core the base is
``kvstream.index._match_native.Record``, a C type that owns them (its constructor is one C call:
what the index and the router build per candidate worker, tens of times per request); without
it (``KVSTREAM_NO_NATIVE=1``, no compiler) :class:`_PyRecord` here, the reference, behaves the
same (tests/test_index_record.py holds them equal).
"""

from __future__ import annotations

import inspect
from dataclasses import FrozenInstanceError
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias, dataclass_transform

from kvstream._native import load as load_native

if TYPE_CHECKING:  # typed by its stub; None at run time when not loaded
    from kvstream.index import _match_native as _native
else:
    _native = load_native("kvstream.index._match_native")

__all__ = ["Record"]


class _PyField:
    """The read-only accessor of a :class:`_PyRecord` field (the twin of the C ``Field``)."""

    __slots__ = ("index", "name")

    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return obj._values[self.index]

    def __set__(self, obj: Any, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {self.name!r}")

    def __delete__(self, obj: Any) -> None:
        raise FrozenInstanceError(f"cannot delete field {self.name!r}")


class _PyRecord:
    """The pure-Python twin of ``_match_native.Record``: the values as one tuple."""

    __slots__ = ("_values",)
    _values: tuple[Any, ...]
    __record_fields__: ClassVar[tuple[str, ...]]
    __record_defaults__: ClassVar[tuple[Any, ...]]

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        names = getattr(cls, "__record_fields__", None)
        if not names:
            raise TypeError(f"{cls.__name__} is not a record class with fields")
        if not kwargs and len(args) == len(names):  # every value positional: the index's call
            obj = object.__new__(cls)
            _set_values(obj, args)
            return obj
        defaults = cls.__record_defaults__
        n = len(names)
        if len(args) > n:
            raise TypeError(
                f"{cls.__name__}() takes {n} positional arguments but {len(args)} were given"
            )
        values: list[Any] = [*args, *(_MISSING,) * (n - len(args))]
        for key, value in kwargs.items():
            if key not in names:
                raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {key!r}")
            j = names.index(key)
            if values[j] is not _MISSING:
                raise TypeError(f"{cls.__name__}() got multiple values for argument {key!r}")
            values[j] = value
        first_default = n - len(defaults)
        for i, v in enumerate(values):
            if v is _MISSING:
                if i < first_default:
                    raise TypeError(f"{cls.__name__}() missing required argument {names[i]!r}")
                values[i] = defaults[i - first_default]
        obj = object.__new__(cls)
        object.__setattr__(obj, "_values", tuple(values))
        return obj

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self) or not isinstance(other, _PyRecord):
            return NotImplemented
        return self._values == other._values

    def __hash__(self) -> int:
        return hash(self._values)

    def __repr__(self) -> str:
        pairs = zip(self.__record_fields__, self._values, strict=True)
        return f"{type(self).__qualname__}({', '.join(f'{n}={v!r}' for n, v in pairs)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self._values)


_MISSING: Any = object()
#: the ``_values`` slot's setter (object.__setattr__ without the attribute lookup)
_set_values: Any = _PyRecord.__dict__["_values"].__set__

if TYPE_CHECKING:
    _Base: TypeAlias = _PyRecord
    _FieldType: TypeAlias = _PyField
else:
    _Base = _PyRecord if _native is None else _native.Record
    _FieldType = _PyField if _native is None else _native.Field


@dataclass_transform(frozen_default=True, eq_default=True)
class Record(_Base):
    """The base of an immutable result record (see the module docstring). Raises TypeError
    when a subclass lacks ``__slots__ = ()``, derives from another record class, or declares
    a field without a default after one with."""

    __slots__ = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__bases__ != (Record,):
            raise TypeError(f"{cls.__name__}: a record class derives from Record alone")
        if cls.__dict__.get("__slots__", None) != ():
            raise TypeError(f"{cls.__name__}: a record class declares __slots__ = ()")
        names = tuple(inspect.get_annotations(cls))
        if not names:
            raise TypeError(f"{cls.__name__}: a record class declares at least one field")
        defaults: list[Any] = []
        for i, name in enumerate(names):
            if name in cls.__dict__:
                defaults.append(cls.__dict__[name])
            elif defaults:
                raise TypeError(
                    f"{cls.__name__}: field {name!r} without a default follows one with"
                )
            setattr(cls, name, _FieldType(i, name))
        cls.__record_fields__ = names
        cls.__record_defaults__ = tuple(defaults)
        setattr(cls, "__match_args__", names)  # noqa: B010 (a class attribute mypy forbids)

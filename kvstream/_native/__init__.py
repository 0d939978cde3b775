"""kvstream's native core: the one loader and the one switch for its C extension modules.

kvstream ships one C extension module per role (:data:`EXTENSIONS`: hashing, codec/wire,
index, workloads; pyproject.toml's ``ext-modules`` builds them, a test checks the two agree).
Each carries its parts, the native twins of Python modules, listed in :data:`MODULES` by the
name their users load them under; a part is loaded through :func:`load`, never imported
directly, so that:

- ``KVSTREAM_NO_NATIVE=1`` (any value but empty or ``0``) turns every one of them off, and
  each user falls back to its pure-Python twin (same results, tested for parity);
- a missing build is loud: the first :func:`load` of a module that did not build warns once
  (:class:`NativeMissingWarning`) naming it and how to rebuild, and with
  ``KVSTREAM_REQUIRE_NATIVE=1`` (what CI sets) it raises :class:`NativeBuildError` instead;
- :func:`report` says which parts are active (``kvstream --version``, the ``native`` label of
  ``kvstream_build_info``).

Both variables are read when a module is first loaded; a module's answer is cached for the
life of the process. This package is at layer 0: it imports nothing else from kvstream.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from importlib import import_module
from types import ModuleType
from typing import Final

__all__ = [
    "EXTENSIONS",
    "MODULES",
    "NativeBuildError",
    "NativeMissingWarning",
    "disabled",
    "import_part",
    "load",
    "report",
    "required",
]

#: Every native part, by the name its users load it under, and its role: the extension module
#: (pyproject.toml's ``ext-modules``, one per role) that carries it as a submodule.
MODULES: Final[dict[str, str]] = {
    "kvstream.hashing._v1native": "hashing",
    "kvstream.hashing._chainnative": "hashing",
    "kvstream.engines._wire_native": "codec",
    "kvstream.codec._tokens_native": "codec",
    "kvstream.codec._columns_native": "codec",
    "kvstream.index._table_native": "index",
    "kvstream.index._match_native": "index",
    "kvstream._native._index": "index",
    "kvstream.workloads._mooncake_native": "workloads",
}

#: Each role's extension module.
EXTENSIONS: Final[dict[str, str]] = {
    "hashing": "kvstream._native._hashing",
    "codec": "kvstream._native._codec",
    "index": "kvstream._native._index",
    "workloads": "kvstream._native._workloads",
}

_REBUILD: Final = "pip install --force-reinstall --no-deps kvstream (with a C compiler present)"


class NativeMissingWarning(RuntimeWarning):
    """A native module did not build (or does not load): its pure-Python twin runs instead."""


class NativeBuildError(ImportError):
    """A native module is missing while ``KVSTREAM_REQUIRE_NATIVE`` asks for every one."""


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def disabled() -> bool:
    """Whether ``KVSTREAM_NO_NATIVE`` turns the native core off."""
    return _flag("KVSTREAM_NO_NATIVE")


def required() -> bool:
    """Whether ``KVSTREAM_REQUIRE_NATIVE`` makes a missing native module an error."""
    return _flag("KVSTREAM_REQUIRE_NATIVE") and not disabled()


_loaded: dict[str, ModuleType | None] = {}
_status: dict[str, str] = {}


def load(name: str) -> ModuleType | None:
    """The extension module ``name`` (a key of :data:`MODULES`), or None when the native
    core is disabled or the module did not build.

    A module that is missing or fails to import warns once per process
    (:class:`NativeMissingWarning`), or raises :class:`NativeBuildError` when
    :func:`required`. Raises KeyError for a name not in :data:`MODULES`.
    """
    if name not in MODULES:
        raise KeyError(f"{name!r} is not one of kvstream's native modules")
    if name in _loaded:
        return _loaded[name]
    mod: ModuleType | None = None
    if disabled():
        _status[name] = "off (KVSTREAM_NO_NATIVE)"
    else:
        extension = EXTENSIONS[MODULES[name]]
        try:
            mod = import_part(name)
        except ImportError as exc:
            why = "not built" if getattr(exc, "name", None) == extension else f"failed: {exc}"
            _status[name] = why
            if required():
                raise NativeBuildError(
                    f"native module {name} is {why} and KVSTREAM_REQUIRE_NATIVE is set"
                ) from exc
            warnings.warn(
                f"kvstream's native module {name} is {why}: its pure-Python twin runs "
                f"instead (slower, same results). Rebuild with: {_REBUILD}; or set "
                "KVSTREAM_NO_NATIVE=1 to choose pure Python and silence this.",
                NativeMissingWarning,
                stacklevel=2,
            )
        else:
            _status[name] = "active"
    _loaded[name] = mod
    return mod


def import_part(name: str) -> ModuleType:
    """The native part ``name`` (a key of :data:`MODULES`), imported through its role's
    extension module whatever the switch says: for tests and tools that hold a part against
    its twin. ImportError when the extension did not build; library code uses :func:`load`."""
    extension = import_module(EXTENSIONS[MODULES[name]])
    if extension.__name__ == name:  # the index core is its role's module
        return extension
    part = getattr(extension, name.rpartition(".")[2], None)
    if not isinstance(part, ModuleType):
        raise ImportError(f"{extension.__name__} has no part {name}", name=name)
    return part


def report() -> dict[str, str]:
    """Module name -> ``"active"``, ``"off (KVSTREAM_NO_NATIVE)"``, ``"not built"`` or
    ``"failed: <error>"`` for every native module: what this process decided when the module
    was first loaded (modules not loaded yet are loaded now, as their users would, without
    the warning: a report is how one asks)."""
    for name in MODULES:
        if name not in _status:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NativeMissingWarning)
                with contextlib.suppress(NativeBuildError):
                    load(name)
    return {name: _status[name] for name in MODULES}

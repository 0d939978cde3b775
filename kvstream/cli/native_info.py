"""Which native parts this installation uses (``kvstream --version``, the ``native``
label of ``kvstream_build_info``): a view of :func:`kvstream._native.report`, the one loader
every user of a native module goes through (``KVSTREAM_NO_NATIVE`` honoured there).
"""

from __future__ import annotations

from typing import Final

from kvstream._native import MODULES, report

__all__ = ["NATIVE_MODULES", "active_native", "native_status"]

#: Every native part (each in its role's extension module, kvstream._native.EXTENSIONS).
NATIVE_MODULES: Final = tuple(MODULES)


def native_status() -> dict[str, str]:
    """Module name -> ``"active"``, ``"off (KVSTREAM_NO_NATIVE)"``, ``"not built"`` or
    ``"failed: <error>"``."""
    return report()


def active_native() -> list[str]:
    """The short names (``hashing._v1native``) of the native parts in use."""
    return [name.removeprefix("kvstream.") for name, s in native_status().items() if s == "active"]

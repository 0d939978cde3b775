"""kvstream: stream KV-cache telemetry out of LLM inference engines.

Layers (a module imports only its own or lower layers):
L0 ``_types``, ``errors``, ``clock``; L1 ``events``, ``hashing``; L2 ``codec``, ``sink``;
L3 ``cache``, ``pipeline``, ``index``; L4 ``cli``.

Importing the package imports nothing heavy (no pydantic, numpy, torch): ``kvstream version``
and ``kvstream --help`` start in a fraction of a second.
"""

from typing import Final

from kvstream.errors import KVStreamError

__version__ = "0.1.0"
#: ``kvstream.events.CURRENT_SCHEMA_VERSION`` without importing the event model (for
#: ``kvstream version``); tests/test_cli.py checks that the two agree.
EVENT_SCHEMA_VERSION: Final = 4
__all__ = ["EVENT_SCHEMA_VERSION", "KVStreamError", "__version__"]

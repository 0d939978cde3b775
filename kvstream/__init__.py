"""kvstream: stream KV-cache telemetry out of LLM inference engines.

Layers (a module imports only its own or lower layers):
L0 ``_types``, ``errors``, ``clock``; L1 ``events``, ``hashing``; L2 ``codec``, ``sink``;
L3 ``cache``, ``pipeline``, ``index``; L4 ``cli``.
"""

from kvstream.errors import KVStreamError

__version__ = "0.1.0"
__all__ = ["KVStreamError", "__version__"]

"""Type stub of the optional C extension ``kvstream.engines._wire_native``
(``_wire_native.c``).

msgpack arrays of the vLLM-family wire format read without a Python int per element;
:mod:`kvstream.engines.vllm` holds the pure-Python equivalents. ``buf`` holds exactly one
msgpack array; anything else raises ValueError.
"""

from typing_extensions import Buffer

def u32_array(buf: Buffer) -> bytes:
    """A msgpack array of ints in 0..2**32-1 as packed little-endian uint32."""

def be64_array(buf: Buffer) -> tuple[bytes, ...]:
    """A msgpack array of ints in 0..2**64-1, each as 8 bytes big-endian."""

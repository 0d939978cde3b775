"""Configuration of a :class:`~kvstream.cache.manager.KVCacheManager`.

A model's layers are split into layer groups by attention window: one group for the
full-attention layers, one per sliding-window size. Each group has its own block pool (and
its own event stream, ``layer_group_id`` = its index in :attr:`CacheConfig.groups`). Global
layer ids run through the groups in order: group 0's layers are ``0..n0-1``, group 1's are
``n0..n0+n1-1``, and so on.

Both classes validate on construction and raise :class:`~kvstream.errors.ConfigError` naming
the field. Nothing here imports torch: dtypes are named by string (``"float16"``, or a
``torch.dtype``, which is normalised to its name) and the device is resolved by the manager.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvstream.cache.tier_config import DiskTierConfig, HostTierConfig
from kvstream.errors import ConfigError, HashingError, UnknownHashAlgorithmError
from kvstream.events.model import AttentionKind
from kvstream.hashing import BlockHasher, get_hasher

__all__ = ["DTYPES", "CacheConfig", "LayerGroupSpec"]

#: dtype name -> bytes per element, for the dtypes a KV pool may use.
DTYPES: Final[Mapping[str, int]] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
_I32_MAX: Final = 2**31 - 1


def _positive_int(value: object, name: str, *, maximum: int = 2**62) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not 1 <= value <= maximum:
        raise ConfigError(f"{name} must be in 1..{maximum}, got {value}")
    return value


def _dtype_name(value: object, name: str) -> str:
    text = str(value).removeprefix("torch.") if not isinstance(value, str) else value
    if text not in DTYPES:
        raise ConfigError(f"{name} must be one of {', '.join(DTYPES)}, got {value!r}")
    return text


@dataclass(frozen=True)
class LayerGroupSpec:
    """One layer group: layers sharing an attention window, and their block pool.

    ``num_layers``, ``num_kv_heads``, ``head_dim`` shape the K/V of one token of one layer;
    ``num_blocks`` sizes the pool; ``window_size`` is the sliding window in tokens (None for
    full attention): a token at position ``p`` needs the K/V of positions ``[p - window, p)``;
    ``dtype`` names the K/V element type (see :data:`DTYPES`).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    window_size: int | None = None
    dtype: str = "float16"

    def __post_init__(self) -> None:
        where = "LayerGroupSpec"
        _positive_int(self.num_layers, f"{where}.num_layers", maximum=_I32_MAX)
        _positive_int(self.num_kv_heads, f"{where}.num_kv_heads", maximum=_I32_MAX)
        _positive_int(self.head_dim, f"{where}.head_dim", maximum=_I32_MAX)
        _positive_int(self.num_blocks, f"{where}.num_blocks", maximum=_I32_MAX)
        if self.window_size is not None:
            _positive_int(self.window_size, f"{where}.window_size")
        object.__setattr__(self, "dtype", _dtype_name(self.dtype, f"{where}.dtype"))

    @property
    def attention_kind(self) -> AttentionKind:
        """FULL for full attention, SLIDING_WINDOW when ``window_size`` is set."""
        return AttentionKind.FULL if self.window_size is None else AttentionKind.SLIDING_WINDOW

    def block_bytes(self, tokens_per_block: int) -> int:
        """Bytes of one block (all layers, K and V)."""
        elems = self.num_layers * 2 * tokens_per_block * self.num_kv_heads * self.head_dim
        return elems * DTYPES[self.dtype]


@dataclass(frozen=True)
class CacheConfig:
    """Everything a :class:`~kvstream.cache.manager.KVCacheManager` needs.

    - ``tokens_per_block``: tokens per block, the same for every group.
    - ``groups``: the layer groups (at least one); group ``i`` is ``layer_group_id`` ``i``.
    - ``device``: ``"auto"`` (``cuda`` when available, else ``cpu``) or a torch device string.
    - ``hash_algo``/``hash_params``: any registered block-hash algorithm and its parameters
      (checked here by building the hasher).
    - ``max_seq_len``: the ``window_size`` that full-attention groups publish in events
      (DESIGN §2.1); sliding-window groups publish their window.
    - ``events``: record events (an :class:`~kvstream.events.emitter.EventEmitter` holding at
      most ``event_capacity`` events between takes) or not (a null recorder: no event work).
    - ``metadata_only``: no K/V tensors at all (block bookkeeping and events only), for
      simulations at scale; ``write_kv``/``read_kv`` then raise.
    - ``host_tier``: a host tier that GPU evictions move into (bookkeeping only when
      ``metadata_only``); ``disk_tier``: a disk store below it (needs tensors). See
      :mod:`kvstream.cache.tier_config`.
    """

    tokens_per_block: int
    groups: Sequence[LayerGroupSpec]
    device: str = "auto"
    hash_algo: str = "blake3"
    hash_params: Mapping[str, Any] = field(default_factory=dict)
    max_seq_len: int = 131072
    events: bool = True
    event_capacity: int = 65536
    metadata_only: bool = False
    host_tier: HostTierConfig | None = None
    disk_tier: DiskTierConfig | None = None

    def __post_init__(self) -> None:
        _positive_int(self.tokens_per_block, "tokens_per_block", maximum=_I32_MAX)
        groups_obj: object = self.groups
        if isinstance(groups_obj, (str, bytes)) or not isinstance(groups_obj, Sequence):
            raise ConfigError(
                f"groups must be a sequence of LayerGroupSpec, got {type(self.groups).__name__}"
            )
        groups = tuple(self.groups)
        if not groups:
            raise ConfigError("groups must hold at least one LayerGroupSpec")
        for i, g in enumerate(groups):
            if not isinstance(g, LayerGroupSpec):
                raise ConfigError(f"groups[{i}] must be a LayerGroupSpec, got {type(g).__name__}")
        object.__setattr__(self, "groups", groups)
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError(f"device must be a non-empty str, got {self.device!r}")
        _positive_int(self.max_seq_len, "max_seq_len")
        if not isinstance(self.events, bool):
            raise ConfigError(f"events must be a bool, got {self.events!r}")
        if not isinstance(self.metadata_only, bool):
            raise ConfigError(f"metadata_only must be a bool, got {self.metadata_only!r}")
        _positive_int(self.event_capacity, "event_capacity")
        if self.event_capacity < 2:
            raise ConfigError(f"event_capacity must be at least 2, got {self.event_capacity}")
        if not isinstance(self.hash_params, Mapping):
            raise ConfigError(
                f"hash_params must be a mapping, got {type(self.hash_params).__name__}"
            )
        if self.host_tier is not None and not isinstance(self.host_tier, HostTierConfig):
            raise ConfigError(f"host_tier must be a HostTierConfig, got {self.host_tier!r}")
        if self.disk_tier is not None:
            if not isinstance(self.disk_tier, DiskTierConfig):
                raise ConfigError(f"disk_tier must be a DiskTierConfig, got {self.disk_tier!r}")
            if self.metadata_only:
                raise ConfigError("disk_tier needs K/V tensors: it cannot be metadata_only")
        ht = self.host_tier
        if isinstance(ht, HostTierConfig) and ht.blocks != "auto" and len(ht.blocks) != len(groups):
            raise ConfigError(
                f"host_tier.blocks has {len(ht.blocks)} entries for {len(groups)} layer groups"
            )
        self.make_hasher()

    def make_hasher(self) -> BlockHasher:
        """The configured block hasher; ConfigError naming ``hash_algo``/``hash_params``."""
        if not isinstance(self.hash_algo, str):
            raise ConfigError(f"hash_algo must be a str, got {self.hash_algo!r}")
        try:
            return get_hasher(self.hash_algo, **dict(self.hash_params))
        except UnknownHashAlgorithmError as exc:
            raise ConfigError(f"hash_algo: {exc}") from None
        except (TypeError, HashingError) as exc:
            raise ConfigError(f"hash_params for {self.hash_algo!r}: {exc}") from None

    def layout_fingerprint(self) -> str:
        """32 hex digits naming everything that makes two managers' blocks interchangeable:
        ``tokens_per_block``, the hash configuration and every group's shape, dtype and
        window. K/V transfers and disk namespaces require equal fingerprints."""
        doc = {
            "tokens_per_block": self.tokens_per_block,
            "hash_algo": self.hash_algo,
            "hash_params": repr(sorted(self.hash_params.items())),
            "groups": [
                [g.num_layers, g.num_kv_heads, g.head_dim, g.dtype, g.window_size]
                for g in self.groups
            ],
        }
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def num_layers(self) -> int:
        """Layers over all groups."""
        return sum(g.num_layers for g in self.groups)

    def window_of(self, layer_group_id: int) -> int:
        """The ``window_size`` group ``layer_group_id`` publishes in events."""
        w = self.groups[layer_group_id].window_size
        return self.max_seq_len if w is None else w

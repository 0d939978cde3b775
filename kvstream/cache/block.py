"""The metadata of one physical KV block (vLLM's ``KVCacheBlock``)."""

from __future__ import annotations

__all__ = ["Block"]


class Block:
    """One physical block of a layer group's pool.

    ``block_id`` indexes the group's storage tensor. ``ref_cnt`` counts the requests holding
    the block. ``block_hash`` is set while the block is committed (registered in the prefix
    tree, announced to consumers); ``parent`` and ``num_children`` are the prefix-tree links
    of full-attention groups. ``prev_free``/``next_free`` belong to :class:`FreeQueue` alone:
    nothing else reads or writes them.
    """

    __slots__ = (
        "block_hash",
        "block_id",
        "next_free",
        "num_children",
        "parent",
        "prev_free",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.parent: Block | None = None
        self.num_children = 0
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, hash={h})"

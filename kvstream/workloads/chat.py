"""A synthetic multi-turn chat workload: shared system prompts, conversations that grow.

Each conversation picks one of a few system prompts; turn ``t``'s prompt is the system prompt
followed by every earlier user message and model answer and then the new user message, so a
cache reuses the system prompt across conversations and the whole history within one.
Conversations start at random times and their turns follow after a think time; requests
come out sorted by arrival. Everything is a pure function of the parameters and ``seed``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvstream._types import TokenIds
from kvstream.workloads.base import WorkloadRequest, pseudo_tokens

__all__ = ["ChatWorkload", "multi_turn_chats"]


@dataclass(frozen=True)
class ChatWorkload:
    """Parameters of :func:`multi_turn_chats`; ranges are inclusive ``(low, high)``."""

    num_conversations: int = 64
    turns: tuple[int, int] = (2, 6)
    num_system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (256, 1024)
    user_tokens: tuple[int, int] = (16, 256)
    output_tokens: tuple[int, int] = (16, 256)
    duration_ms: float = 60_000.0
    think_time_ms: tuple[float, float] = (2_000.0, 20_000.0)
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("turns", "system_prompt_tokens", "user_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high")
        if self.num_conversations < 0 or self.num_system_prompts < 1 or self.vocab_size < 1:
            raise ValueError("num_conversations >= 0, num_system_prompts >= 1, vocab_size >= 1")


def multi_turn_chats(workload: ChatWorkload | None = None) -> Iterator[WorkloadRequest]:
    """The requests of ``workload`` (default parameters when None), in arrival order.

    Request ids are ``c<conversation>-t<turn>``; prompts are built lazily, one request at a
    time.
    """
    w = workload or ChatWorkload()
    rng = random.Random(w.seed)
    seed = w.seed

    def toks(kind: str, n: int, *key: int) -> TokenIds:
        label = b"chat\x00%d\x00%s" % (seed, kind.encode()) + b"".join(b"\x00%d" % k for k in key)
        return pseudo_tokens(label, n, w.vocab_size)

    system = [
        toks("system", rng.randint(*w.system_prompt_tokens), i) for i in range(w.num_system_prompts)
    ]
    plan: list[tuple[float, int, int]] = []  # (arrival, conversation, turn)
    shapes: list[tuple[int, list[tuple[int, int]]]] = []  # per conversation: system, (user, out)
    for c in range(w.num_conversations):
        n_turns = rng.randint(*w.turns)
        sys_idx = rng.randrange(w.num_system_prompts)
        lens = [
            (rng.randint(*w.user_tokens), rng.randint(*w.output_tokens)) for _ in range(n_turns)
        ]
        shapes.append((sys_idx, lens))
        t = rng.uniform(0.0, w.duration_ms)
        for turn in range(n_turns):
            plan.append((t, c, turn))
            t += rng.uniform(*w.think_time_ms)
    plan.sort()
    for arrival, c, turn in plan:
        sys_idx, lens = shapes[c]
        parts = [system[sys_idx].raw]
        for j in range(turn):
            parts.append(toks("user", lens[j][0], c, j).raw)
            parts.append(toks("out", lens[j][1], c, j).raw)
        parts.append(toks("user", lens[turn][0], c, turn).raw)
        yield WorkloadRequest(
            request_id=f"c{c}-t{turn}",
            arrival_ms=arrival,
            prompt=TokenIds.from_bytes(b"".join(parts)),
            output=toks("out", lens[turn][1], c, turn),
            conversation=c,
            turn=turn,
        )

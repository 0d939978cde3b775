"""A fleet of real vLLM 0.33 engine ranks publishing KV events, for the service peer test and
``benchmarks/bench_serve.py``.

Each :class:`VllmRank` is vLLM's own ``KVCacheManager`` (one full-attention KV-cache group,
its ``BlockPool`` with ``enable_kv_cache_events=True``, requests hashed by
``get_request_block_hasher`` with vLLM's default ``sha256``, int block hashes) driven the way
vLLM's scheduler drives it (a whole prefill, a few decode steps, ``free``), whose
``take_events()`` go out after every request as one ``KVEventBatch`` through vLLM's
``ZmqEventPublisher`` (``EventPublisherFactory.create``), PUB on ``port + dp_rank`` and a replay
ROUTER on ``replay_port + dp_rank``: what a vLLM engine started with
``--kv-events-config '{"publisher": "zmq", ...}'`` sends. The block pool is small, so prefix
reuse and LRU evictions both happen.

:class:`Workload` makes multi-turn conversations over shared system prompts: requests that
share prefixes across ranks and instances, and probes (prefixes of served prompts, with and
without a divergent tail) that exercise partial matches.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

VOCAB = 32_000


class VllmRank:
    """One engine DP rank: vLLM's cache manager and publisher (module docstring)."""

    def __init__(
        self,
        kv: Any,
        port: int,
        replay_port: int,
        *,
        dp_rank: int,
        block_size: int,
        num_blocks: int,
        max_model_len: int = 8192,
    ) -> None:
        import torch
        from vllm.config.kv_events import KVEventsConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )

        self.kv = kv
        self.dp_rank = dp_rank
        self.block_size = block_size
        self.hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(self.hash_fn)
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.attn"], spec)],
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=max_model_len,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        cfg = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{port - dp_rank}",
            replay_endpoint=f"tcp://*:{replay_port - dp_rank}",
            topic="",
        )
        # the factory binds endpoint port + rank, as a DP engine does
        self.publisher = kv.EventPublisherFactory.create(cfg, data_parallel_rank=dp_rank)
        self.port = port
        self.replay_port = replay_port
        self.requests = 0
        self.batches = 0
        self.events = 0
        self.blocks = 0

    def serve(self, prompt: list[int], output: list[int]) -> None:
        """Prefill ``prompt``, decode ``output``, free the request, publish its events."""
        for batch in self.run(prompt, output):
            self.publisher.publish(batch)

    def run(self, prompt: list[int], output: list[int]) -> list[Any]:
        """Like :meth:`serve`, returning the ``KVEventBatch`` instead of publishing it."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=len(output) + 1)
        params.update_from_generation_config({}, eos_token_id=2)
        self.requests += 1
        req = Request(
            request_id=f"r{self.dp_rank}-{self.requests}",
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.block_size, self.hash_fn),
        )
        m = self.manager
        computed, num_computed, _ = m.get_computed_blocks(req)
        if m.allocate_slots(req, req.num_tokens - num_computed, num_computed, computed) is None:
            m.free(req)
            return []  # the pool is full of running requests: rejected, as a scheduler would
        req.num_computed_tokens = req.num_tokens
        for tok in output:
            req.append_output_token_ids(tok)
            if m.allocate_slots(req, 1) is None:
                break
            req.num_computed_tokens += 1
        m.free(req)
        events = m.take_events()
        if not events:
            return []
        for ev in events:
            hashes = getattr(ev, "block_hashes", None)
            self.blocks += len(hashes) if hashes else 0
        self.events += len(events)
        self.batches += 1
        return [self.kv.KVEventBatch(ts=time.time(), events=events)]

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def close(self) -> None:
        self.publisher.shutdown()


@dataclass
class Workload:
    """Multi-turn conversations over shared system prompts (module docstring)."""

    seed: int
    system_prompts: int = 6
    system_tokens: int = 512
    turn_tokens: tuple[int, int] = (40, 200)
    output_tokens: int = 24
    rng: random.Random = field(init=False)
    systems: list[list[int]] = field(init=False)
    served: list[list[int]] = field(init=False, default_factory=list)
    chats: list[list[int]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.systems = [
            [self.rng.randrange(3, VOCAB) for _ in range(self.system_tokens)]
            for _ in range(self.system_prompts)
        ]

    def next_request(self) -> tuple[list[int], list[int]]:
        """A prompt (a new chat, or the next turn of an open one) and its output tokens."""
        rng = self.rng
        turn = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(*self.turn_tokens))]
        if self.chats and rng.random() < 0.6:
            i = rng.randrange(len(self.chats))
            prompt = self.chats[i] + turn
            if len(prompt) > 6000:
                prompt = rng.choice(self.systems) + turn
            self.chats[i] = prompt
        else:
            prompt = rng.choice(self.systems) + turn
            self.chats.append(prompt)
            if len(self.chats) > 64:
                self.chats.pop(0)
        output = [rng.randrange(3, VOCAB) for _ in range(self.output_tokens)]
        self.served.append(prompt)
        return prompt, output

    def probes(self, n: int) -> list[list[int]]:
        """Requests to ask about: served prompts, their prefixes with a new tail, new ones."""
        rng = self.rng
        out: list[list[int]] = []
        for _ in range(n):
            r = rng.random()
            p = rng.choice(self.served) if self.served else rng.choice(self.systems)
            if r < 0.5:
                out.append(list(p))
            elif r < 0.9:
                cut = rng.randrange(1, len(p) + 1)
                out.append(p[:cut] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(0, 64))])
            else:
                out.append([rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 600))])
        return out

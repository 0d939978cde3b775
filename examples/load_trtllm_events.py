"""Load TensorRT-LLM's `LLM.get_kv_cache_events()` output into kvstream's typed model.

Run: python examples/load_trtllm_events.py [events.json]
(without an argument it uses a small built-in sample in TensorRT-LLM's JSON shape)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvstream.engines.trtllm import from_trtllm_events, to_trtllm_events

SAMPLE = [
    {
        "event_id": 0,
        "data": {"type": "created", "num_blocks_per_cache_level": [4096, 0]},
        "window_size": 4096,
    },
    {
        "event_id": 1,
        "data": {
            "type": "stored",
            "parent_hash": None,
            "blocks": [
                {
                    "type": "stored_block",
                    "block_hash": 924206229973855,
                    "tokens": [
                        {"type": "unique_token", "token_id": t, "token_extra_id": 0}
                        for t in (1, 2, 3, 4)
                    ],
                    "cache_level": 0,
                    "priority": 35,
                    "mm_keys": [],
                    "cache_salt": None,
                }
            ],
        },
        "window_size": 4096,
    },
    {
        "event_id": 2,
        "data": {"type": "removed", "block_hashes": [924206229973855]},
        "window_size": 4096,
    },
]


def main() -> None:
    events = json.loads(Path(sys.argv[1]).read_text()) if len(sys.argv) > 1 else SAMPLE
    batches = from_trtllm_events(events, instance_id="trtllm-0", tokens_per_block=4)
    for batch in batches:
        for ev in batch.events:
            print(
                f"rank={batch.source.attention_dp_rank} id={ev.event_id} {ev.data.type}"
                f" hash_algo={ev.hash_algo} window={ev.window_size}"
            )
    # ...and back to TensorRT-LLM's shape, e.g. for a router that only speaks that.
    back = to_trtllm_events(batches)
    print(json.dumps(back[1]["data"]["blocks"][0]["block_hash"]))


if __name__ == "__main__":
    main()

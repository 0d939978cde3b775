"""Foreign wire formats <-> kvstream :class:`~kvstream.events.model.EventBatch` (layer L2).

One module per engine format, and the only place in kvstream that knows them:

- :mod:`.vllm` / :mod:`.sglang`: the msgpack ``KVEventBatch`` payloads vLLM and SGLang
  publish (decode, every encoding those engines ever used);
- :mod:`.vllm_export`: kvstream batches in vLLM's wire format, for Dynamo, llm-d and any
  vLLM-format consumer;
- :mod:`.trtllm`: TensorRT-LLM's JSON KV-cache events, both ways;
- :mod:`.zmq_sub` / :mod:`.zmq_pub`: the ZMQ transport (PUB/SUB frames, sequence numbers,
  the ROUTER/DEALER replay protocol), on pyzmq's asyncio API.

This is the only package that imports msgspec and pyzmq, and it imports them lazily (a
module that needs them imports them itself), so ``import kvstream.engines`` stays cheap.
The cache, the index and the pipeline never know which engine a batch came from.
"""

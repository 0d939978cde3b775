"""Foreign wire formats <-> kvstream :class:`~kvstream.events.model.EventBatch` (layer L2).

One module per engine format, and the only place in kvstream that knows them:

- :mod:`.vllm` / :mod:`.sglang`: the msgpack ``KVEventBatch`` payloads vLLM and SGLang
  publish, decoded from every encoding those engines ever used;
- :mod:`.stream`: one engine instance and DP rank as one kvstream source (contiguous ids,
  incarnations on restart, ``lost`` markers for what never arrived);
- :mod:`.endpoint` / :mod:`.zmq_sub`: ``vllm://`` and ``sglang://`` URLs and following an
  engine's ZMQ stream (sequence numbers, the ROUTER/DEALER replay protocol);
- :mod:`.vllm_export` / :mod:`.zmq_pub`: kvstream batches in vLLM's wire format, published
  as a vLLM engine does, for Dynamo, llm-d and any vLLM-format consumer (the ``vllm://`` sink);
- :mod:`.trtllm`: TensorRT-LLM's JSON KV-cache events both ways, and :func:`.trtllm.pump`,
  which drains ``LLM.get_kv_cache_events_async`` into a pipeline in-process.

This is the only package that imports msgspec and pyzmq, and it imports them lazily (a
module that needs them imports them itself), so ``import kvstream.engines`` stays cheap.
The cache, the index and the pipeline never know which engine a batch came from; index
sources, sinks and the CLI reach these modules through ``open_source()`` / ``create_sink()``
URLs. See docs/engines.md.
"""

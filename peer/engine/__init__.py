"""The local inference engine: one model, a prefix KV cache, generation off the event loop.

  radix.py     pure radix tree over token blocks: match, locks, LRU eviction, change events
               (no torch: the simulator imports it too)
  kv.py        per-block KV tensors, the byte budget, rebuilding a transformers cache
  model.py     loading: aliases smollm2-135m (offline GGUF, converted once) and
               tiny-random, local checkpoint folders, hub ids
  speeds.py    pure: how the advertised prefill and decode speeds are measured (the
               simulator imports it too)
  requests.py  a request's parameters and limits, the events it yields, sampling and
               stop strings
  engine.py    Engine: validate, match, prefill only the uncached suffix, decode, stream,
               insert; load() and statistics() for the router and metrics

Nothing is imported here, so that `peer.engine.radix` and `peer.engine.speeds` stay free
of torch.
"""

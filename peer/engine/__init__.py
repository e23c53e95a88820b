"""The local inference engine: one model, a prefix KV cache, continuous batching off the
event loop (docs/engine.md). Imports nothing above it in peer/.

  api.py         torch-free: the one engine interface (EngineView, GeneratingEngine), the
                request, sampling, usage, load and verdict types, limits
  cache_only.py  an EngineView with a radix cache and no model (tests, the gossip bench)
  scheduler.py   pure: what the next batched step computes (decodes + chunked prefill),
                and BatchQueue, the batch state machine (waiting, admitted, planned)
  radix.py       pure radix tree over token blocks: match, locks, LRU eviction, change
                events (no torch: the simulator imports it too)
  speeds.py      pure: how the advertised prefill and decode speeds are measured
  text.py        torch-free: generated ids to text with stop strings (StopTracker)
  kv.py          a block's KV shape and bytes, the byte budget in blocks
  runner.py      the packed forward over all scheduled sequences, per-sequence KV buffers
  model.py       loading: aliases smollm2-135m (offline GGUF, converted once) and
                tiny-random, local checkpoint folders, hub ids; dtype, device, threads
  sampling.py    the seeded sampler: Gumbel-max keyed by (seed, position), its hash
  requests.py    a request's state, prompt checks, the next token (argmax or sampling.py)
  warmup.py      the warm-up run that seeds the advertised speeds
  batch.py       BatchLoop: drives BatchQueue; admit (match, lock) and step (compute in a
                worker thread, apply, insert)
  verify.py      teacher-forced checks of another peer's output, and their driver
  engine.py      Engine (a BatchLoop): load, validate, stream, verify; load(), statistics()

Nothing is imported here, so that the pure modules stay free of torch.
"""

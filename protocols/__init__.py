"""prefixswarm wire protocols: pure, sans-IO formats and algorithms.

Nothing here imports trio, libp2p, torch or transformers (tests/test_purity.py checks),
so the live peer and the simulator run the same code.

- errors.py   RemoteProtocolError: the other side sent something invalid
- ids.py      protocol ids, gossip topic per model, DHT provider key per model
- blocks.py   BlockHasher: the 64-bit hash chain over full blocks of token ids
- bloom.py    BloomFilter (blocked, sized from capacity and false-positive target),
              Probes / ProbeCache: a chain mixed once and tested against many filters
- bloom_bank.py BloomBank: filters of one shape bit-sliced (numpy), prefix counts for all
- summary.py  CacheSummary: a peer's cache filter, load and speed; strict CBOR codec
- framing.py  length-prefixed CBOR frames, FrameDecoder, strict decode_cbor
- infer.py    inference request / token / result / error frames
"""

"""What peers know of each other: summaries, the peer table, gossip and the ring lookup.

  local_summary.py     pure: this peer's summary, built from the engine's cache state
  bloom_sizing.py      pure: the shape of the Bloom filter a summary carries
  incremental_bloom.py pure: that filter kept current from the cache's events
  publish_policy.py    pure: when to publish (interval, change threshold)
  peer_table.py        pure: what this peer believes about the others
  neighbourhood.py     pure: ring positions and gossip neighbours (ring mode)
  interest.py, providers.py   pure: the ring lookup's cores
  gossip.py            the gossipsub shell: publish ours, validate and apply others'
  lookup.py            the shell of the ring lookup (/prefixswarm/roots/1.0.0)

May import: net/, engine/, config and root utilities, protocols/.
"""

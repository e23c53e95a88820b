"""Where a request should run: candidates ranked by estimated cost, checked by probes,
weighed by what each peer did before.

  cost.py            pure: the one cost formula (network, queue, prefill, decode)
  router.py          pure: routing policies -> ranked candidates with reasons
  probing.py         pure: when a load probe is worth its cost, and what it says
  probe_service.py   the load-probe protocol's shell
  decide.py          pure: rank -> probe -> rerank, what to do next with the ranking
  trust.py           pure: the trust ledger (probation, verification, quarantine)

May import: swarm/, net/, engine/, config and root utilities, protocols/.
"""

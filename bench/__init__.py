"""Benchmarks, each `python -m bench.NAME --json PATH`, printing JSON.

engine     time to first token with prefix reuse vs plain transformers (one peer)
router     median routing decision time, 64 peers, 64-block prompt
gossip     8 peer processes: gossip bytes, CPU share, summary propagation delay
simulate   discrete-event swarm simulator on the real cores (sim/), the evaluation sweeps
swarm      N real peer processes, the MMLU workload over HTTP, per routing policy
workloads  MMLU 5-shot, shared system prompts and multi-turn chat workloads (a library)
"""

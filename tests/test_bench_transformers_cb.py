"""bench/transformers_cb.py: transformers' continuous batching on the bench's closed loop."""

import torch

from bench.transformers_cb import peak_rss_bytes, reset_peak_rss, transformers_cb_concurrent


def test_closed_loop_matches_generate_and_counts_shared_prefixes(tiny_model):
    shared = [(7 * i) % 500 + 3 for i in range(48)]  # three full 16-token blocks
    prompts = [[*shared, 600 + i, 601 + i] for i in range(3)]
    attn = tiny_model.model.config._attn_implementation
    model = tiny_model.model
    r = transformers_cb_concurrent(model, prompts, 2, 4, block_sharing=True, warmup=False)
    assert tiny_model.model.config._attn_implementation == attn  # put back
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        out = tiny_model.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False
        )
        expected.append(out[0, len(p) :].tolist())
    assert r["outputs"] == expected
    assert r["cached_tokens"] >= 48  # the third prompt at least reuses the shared blocks
    assert r["tokens_per_s"] > 0 and r["ttft_p50_s"] is not None


def test_peak_rss_can_be_reset():
    assert reset_peak_rss()
    peak = peak_rss_bytes()
    assert peak is not None and peak > 0

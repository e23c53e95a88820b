"""The compiled decode step: the same logits and KV as the eager packed step, any buffer
capacity on one graph, and the eager step whenever the compiled one refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from peer.engine.api import SamplingParams
from peer.engine.compiled_decode import CompiledDecode, CompileDecodeError, supported
from peer.engine.engine import Engine
from peer.engine.kv import KVLayout
from peer.engine.model import ModelLoadError, load_model
from peer.engine.runner import Runner, SeqKV
from tests.helpers_engine import NEEDS_CXX

PROMPT = [(7 * i + 3) % 500 + 1 for i in range(37)]

pytestmark = NEEDS_CXX


@pytest.fixture(scope="module")
def compiled_model():
    """tiny-random (float32) with its decode step compiled (seconds; once per module)."""
    return load_model("tiny-random", compile_decode=True)


def runner_of(loaded, decode_step=None) -> Runner:
    itemsize = next(loaded.model.parameters()).element_size()
    layout = KVLayout(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, 16, itemsize)
    return Runner(loaded.model, layout, decode_step, loaded.threads)


def prefilled(runner: Runner, capacity: int) -> tuple[SeqKV, int]:
    kv = runner.new_kv([], capacity)
    logits = runner.forward([(kv, PROMPT)], [1])
    return kv, int(logits[0].argmax())


def test_compiled_steps_give_the_eager_logits_and_kv(compiled_model):
    eager = runner_of(compiled_model)
    compiled = runner_of(compiled_model, compiled_model.decode_step)
    kv_e, tok_e = prefilled(eager, len(PROMPT) + 12)
    kv_c, tok_c = prefilled(compiled, len(PROMPT) + 12)
    assert tok_e == tok_c
    before = compiled_model.decode_step.steps
    for _ in range(12):
        logits_e = eager.forward([(kv_e, [tok_e])], [1])
        logits_c = compiled.forward([(kv_c, [tok_c])], [1])
        assert logits_c.shape == logits_e.shape
        torch.testing.assert_close(logits_c, logits_e, atol=1e-4, rtol=1e-4)
        tok_e, tok_c = int(logits_e[0].argmax()), int(logits_c[0].argmax())
        assert tok_e == tok_c
    assert compiled_model.decode_step.steps == before + 12  # the compiled path ran
    assert kv_c.length == kv_e.length == len(PROMPT) + 12
    filled = slice(0, kv_c.length)
    torch.testing.assert_close(kv_c.data[:, :, :, filled], kv_e.data[:, :, :, filled],
                               atol=1e-4, rtol=1e-4)


def test_any_capacity_runs_on_the_one_graph(compiled_model):
    step = compiled_model.decode_step
    runner = runner_of(compiled_model, step)
    for capacity in (len(PROMPT) + 1, len(PROMPT) + 300):
        kv, tok = prefilled(runner, capacity)
        before = step.steps
        runner.forward([(kv, [tok])], [1])  # a recompile would raise and drop the step
        assert step.steps == before + 1
        assert runner.decode_step is step


def test_only_a_lone_decoding_sequence_takes_the_compiled_step(compiled_model):
    step = compiled_model.decode_step
    runner = runner_of(compiled_model, step)
    (kv_a, tok_a), (kv_b, tok_b) = prefilled(runner, 60), prefilled(runner, 60)
    before = step.steps
    runner.forward([(kv_a, [tok_a]), (kv_b, [tok_b])], [1, 1])  # a batch of two
    runner.forward([(kv_a, [tok_a, tok_b])], [1])  # a chunk of two tokens
    assert step.steps == before


async def test_greedy_answers_are_the_same_compiled_or_not(compiled_model):
    params = SamplingParams(max_new_tokens=24)
    compiled = Engine.from_model(compiled_model)
    assert compiled.runner.decode_step is compiled_model.decode_step
    eager_model = load_model("tiny-random")
    eager = Engine.from_model(eager_model)
    assert eager.runner.decode_step is None
    before = compiled_model.decode_step.steps
    got = await compiled.generate(PROMPT, params)
    want = await eager.generate(PROMPT, params)
    assert got.token_ids == want.token_ids
    assert compiled_model.decode_step.steps == before + 23  # every token after the first


def test_a_refused_step_falls_back_to_the_eager_step(compiled_model, capsys):
    calls = []

    class Refusing:
        def accepts(self, kv: SeqKV) -> bool:
            return True

        def __call__(self, kv: SeqKV, token: int) -> torch.Tensor:
            calls.append(token)
            raise CompileDecodeError("not built for this input")

    runner = runner_of(compiled_model, Refusing())
    eager = runner_of(compiled_model)
    kv, tok = prefilled(runner, 50)
    kv_e, _ = prefilled(eager, 50)
    logits = runner.forward([(kv, [tok])], [1])
    torch.testing.assert_close(logits, eager.forward([(kv_e, [tok])], [1]))
    assert kv.length == len(PROMPT) + 1
    assert calls == [tok] and runner.decode_step is None  # never asked again
    assert "decoding eagerly from now on" in capsys.readouterr().err
    runner.forward([(kv, [tok])], [1])
    assert calls == [tok]


def test_the_last_position_of_a_buffer_is_fed_eagerly(compiled_model):
    """The graph is built for a window inside its buffer; a buffer's last position (a
    buffer made without Runner.new_kv's spare one) goes through the eager step."""
    step = compiled_model.decode_step
    runner = runner_of(compiled_model, step)
    kv = runner.new_kv([], len(PROMPT) + 2)
    tok = int(runner.forward([(kv, PROMPT)], [1])[0].argmax())
    before = step.steps
    while kv.length < kv.capacity:
        tok = int(runner.forward([(kv, [tok])], [1])[0].argmax())
    assert step.steps == before + 2  # all but the spare, last position
    assert runner.decode_step is step


def test_a_step_not_compiled_yet_refuses(compiled_model):
    step = CompiledDecode(compiled_model.model)
    kv = runner_of(compiled_model).new_kv([], 8)
    with pytest.raises(CompileDecodeError, match="not compiled"):
        step(kv, 1)
    assert kv.length == 0


def test_models_it_cannot_compile_are_named():
    cpu = torch.nn.Linear(1, 1)

    def fake(model_type: str, tp: int = 1, device_module=cpu):
        config = SimpleNamespace(model_type=model_type, pretraining_tp=tp)
        return SimpleNamespace(config=config, parameters=device_module.parameters)

    assert supported(fake("llama")) is None
    assert "not gpt2" in (supported(fake("gpt2")) or "")
    assert "pretraining_tp" in (supported(fake("llama", tp=2)) or "")
    with pytest.raises(CompileDecodeError, match="Llama"):
        CompiledDecode(fake("mistral"))


def test_garbage_past_the_filled_positions_never_reaches_the_logits(compiled_model):
    """A sequence's buffer is allocated uninitialised: what lies past its tokens (here
    NaN) is zeroed before the compiled step reads it."""
    compiled = runner_of(compiled_model, compiled_model.decode_step)
    eager = runner_of(compiled_model)
    kv_c, tok = prefilled(compiled, 300)
    kv_e, _ = prefilled(eager, 300)
    kv_c.data[:, :, :, kv_c.length:] = float("nan")
    for _ in range(3):
        logits = compiled.forward([(kv_c, [tok])], [1])
        assert torch.isfinite(logits).all()
        torch.testing.assert_close(logits, eager.forward([(kv_e, [tok])], [1]),
                                   atol=1e-4, rtol=1e-4)
        tok = int(logits[0].argmax())
    assert compiled.decode_step is compiled_model.decode_step
    assert torch.isnan(kv_c.data[:, :, :, 128:]).all()  # past the window: never touched


def test_a_failed_compile_is_one_clear_load_error(monkeypatch):
    import peer.engine.compiled_decode as compiled_decode

    def no_compiler(self):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(compiled_decode.CompiledDecode, "compile", no_compiler)
    with pytest.raises(ModelLoadError, match=r"C\+\+ compiler.*without --compile-decode"):
        load_model("tiny-random", compile_decode=True)


def test_a_thread_with_another_torch_thread_count_still_takes_the_compiled_step(compiled_model):
    """The graph is built for the thread count at compile time; a worker thread whose
    count differs (OpenMP's is per thread) gets the model's count back from the runner,
    not a recompile and the eager step from then on."""
    import threading

    runner = runner_of(compiled_model, compiled_model.decode_step)
    kv, tok = prefilled(runner, len(PROMPT) + 8)
    compiled_at = torch.get_num_threads()
    assert compiled_model.threads == compiled_at
    before = compiled_model.decode_step.steps
    seen = []

    def other_count() -> None:
        torch.set_num_threads(compiled_at + 1)
        runner.forward([(kv, [tok])], [1])
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=other_count)
    worker.start()
    worker.join()
    try:
        assert runner.decode_step is compiled_model.decode_step  # no fallback to eager
        assert compiled_model.decode_step.steps == before + 1
        assert seen == [compiled_at]
    finally:
        torch.set_num_threads(compiled_at)


@pytest.fixture(scope="module")
def compiled_int4():
    """tiny-random in int4, its decode step compiled; and how many of the step's products
    inductor timed a C++ kernel of its own for against torch's while compiling it (with
    its caches off: a graph read back from an earlier run's cache on disk counts none).
    Without frozen weights it has no C++ candidate and times nothing; which candidate
    wins is a timing, and on a loaded machine (`make test`) it was torch's once, so the
    count of C++ kernels written is no test of freezing."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    before = counters["inductor"]["select_algorithm_autotune"]
    with inductor_config.patch(force_disable_caches=True):
        loaded = load_model("tiny-random", dtype="int4", compile_decode=True)
    return loaded, counters["inductor"]["select_algorithm_autotune"] - before


def test_a_quantized_step_is_compiled_on_frozen_weights_and_keeps_the_eager_logits(
        compiled_int4):
    """The weights are frozen into the graph (Dynamo reads `freezing` from the global
    config: passed only as a compile option it froze nothing), which is what lets the
    int4 and int8 products become inductor's C++ kernels where it times them faster. They
    sum in another order and round to bfloat16 elsewhere, so each step's logits, fed the
    same tokens, are the eager step's to a few bfloat16 steps (logits here reach ~8,
    where one step is 1/32); a wrong weight or layout would be off by whole units."""
    loaded, timed = compiled_int4
    assert timed > 0
    eager = runner_of(loaded)
    compiled = runner_of(loaded, loaded.decode_step)
    kv_e, tok = prefilled(eager, len(PROMPT) + 12)
    kv_c, _ = prefilled(compiled, len(PROMPT) + 12)
    before = loaded.decode_step.steps
    for _ in range(12):
        logits_e = eager.forward([(kv_e, [tok])], [1])
        logits_c = compiled.forward([(kv_c, [tok])], [1])
        gap = (logits_c - logits_e).abs()
        assert float(gap.max()) < 0.4 and float(gap.mean()) < 0.08
        tok = int(logits_e[0].argmax())
    assert loaded.decode_step.steps == before + 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_written_out_attention_is_grouped_query_attention(dtype):
    """grouped_attention (the compiled step's, not SDPA: see its docstring) reads each query
    head's own K/V head and only the masked-in positions, as SDPA with enable_gqa does."""
    from peer.engine.compiled_decode import grouped_attention

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, window, dim, filled = 6, 2, 40, 8, 29
    q = torch.randn(1, heads, 1, dim, generator=gen).to(dtype)
    keys = torch.randn(kv_heads, window, dim, generator=gen).to(dtype)
    values = torch.randn(kv_heads, window, dim, generator=gen).to(dtype)
    mask = (torch.arange(window) < filled).view(1, 1, 1, window)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), keys.float().unsqueeze(0), values.float().unsqueeze(0), attn_mask=mask,
        scale=0.3, enable_gqa=True).transpose(1, 2)
    got = grouped_attention(q, keys, values, mask, 0.3)
    assert got.dtype == dtype and got.shape == (1, 1, heads, dim)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)
    keys[:, filled:] = 1e3  # positions masked out never reach the output (finite ones:
    values[:, filled:] = -1e3  # the step zeroes the window, as a NaN times 0 is NaN)
    assert torch.equal(grouped_attention(q, keys, values, mask, 0.3), got)

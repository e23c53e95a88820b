"""Start-up progress: the bar (peer/progress.py) and the engine warm-up that feeds it."""

import io

import pytest

from peer.progress import BAR_MIN_INTERVAL_S, Bar, is_terminal, render_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def frames(out: io.StringIO) -> list[str]:
    """The lines a terminal would have shown, one per redraw (padding stripped)."""
    return [f.rstrip() for f in out.getvalue().split("\r") if f.strip()]


def test_render_bar_fills_in_proportion_and_clamps():
    assert render_bar("w", 0, 4, width=8) == "prefixswarm: w [........] 0/4"
    assert render_bar("w", 2, 4, "decode", width=8) == "prefixswarm: w [####....] 2/4 decode"
    assert render_bar("w", 9, 4, width=8) == "prefixswarm: w [########] 4/4"
    assert render_bar("w", 3, 12, width=8) == "prefixswarm: w [##......]  3/12"
    assert render_bar("w", 1, 0, width=4) == "prefixswarm: w [####] 1/1"  # no division by 0


def test_bar_redraws_in_place_on_a_terminal_at_most_every_interval_and_always_at_the_end():
    out = Terminal()
    now = [0.0]
    bar = Bar("warm-up", out=out, clock=lambda: now[0])
    bar.update(1, 4, "decode")
    now[0] += BAR_MIN_INTERVAL_S / 2
    bar.update(2, 4, "decode")  # too soon: skipped
    now[0] += BAR_MIN_INTERVAL_S
    bar.update(3, 4, "prefill 128 tokens")
    bar.update(4, 4)  # the last one is drawn however soon
    bar.close()
    assert bar.drawn == 3
    shown = frames(out)
    assert [s.split("] ")[1] for s in shown] == ["1/4 decode", "3/4 prefill 128 tokens", "4/4"]
    assert out.getvalue().endswith("\n") and out.getvalue().count("\n") == 1
    # a shorter line blanks the rest of the longer one before it
    assert out.getvalue().split("\r")[3].startswith(render_bar("warm-up", 4, 4) + " ")


@pytest.mark.parametrize("enabled", [None, False])
def test_bar_is_silent_off_a_terminal_or_when_disabled(enabled):
    out = io.StringIO() if enabled is None else Terminal()
    bar = Bar("warm-up", out=out, enabled=enabled)
    for i in range(1, 5):
        bar.update(i, 4)
    bar.close()
    assert out.getvalue() == "" and bar.drawn == 0


def test_is_terminal_of_odd_streams():
    closed = io.StringIO()
    closed.close()
    assert not is_terminal(closed)  # isatty on a closed stream raises ValueError
    assert not is_terminal(object())  # type: ignore[arg-type]
    assert not is_terminal(io.StringIO())
    assert is_terminal(Terminal())


def test_warmup_reports_every_forward_up_to_its_total(tiny_engine):
    from peer.engine.warmup import WARMUP_DECODE_PASSES, WARMUP_DECODE_TOKENS, warmup_forwards

    seen: list[tuple[int, int, str]] = []
    tiny_engine.warmup(lambda done, total, label: seen.append((done, total, label)))
    total = warmup_forwards(tiny_engine.max_context // 2)
    assert {t for _, t, _ in seen} == {total}
    done = [d for d, _, _ in seen]
    assert done == sorted(set(done)) and done[0] == 1 and done[-1] == total  # ends full
    decodes = WARMUP_DECODE_PASSES * (1 + WARMUP_DECODE_TOKENS)
    assert [label for _, _, label in seen[:decodes]] == ["decode"] * decodes
    assert seen[decodes][2] == "prefill 64 tokens"  # then the prefill probe, doubling
    assert tiny_engine.load().decode_tokens_per_s > 0


def test_warmup_forwards_counts_the_doubling_prefill_probes():
    from peer.engine.warmup import max_prefill_probes, warmup_forwards

    assert [max_prefill_probes(n) for n in (10, 64, 127, 128, 1024)] == [1, 1, 1, 2, 5]
    assert warmup_forwards(1024) == 10 + 5


class FakeEngine:
    """What the CLI's start-up uses of an engine (the real warm-up is tested above)."""

    warmed_up = False

    def warmup(self, progress=None):
        for done in range(1, 5):
            progress(done, 4, "decode")
        self.warmed_up = True


def test_serve_start_up_draws_the_warm_up_bar_on_a_terminal(monkeypatch):
    from peer.cli import _load_engine
    from peer.config import PeerConfig

    engine = FakeEngine()
    monkeypatch.setattr("peer.engine.engine.load_engine", lambda *a, **k: engine)

    err = Terminal()
    monkeypatch.setattr("sys.stderr", err)
    assert _load_engine(PeerConfig(model="tiny-random")) is engine
    text = err.getvalue()
    assert text.startswith("prefixswarm: warming up the engine (measuring its speeds)...\n")
    bar_line, done_line = text.splitlines()[-2:]
    assert bar_line.split("\r")[-1].startswith("prefixswarm: warm-up [" + "#" * 30 + "]")
    assert done_line.startswith("prefixswarm: warming up the engine (measuring its speeds): done")


def test_serve_start_up_off_a_terminal_has_stage_lines_only(monkeypatch):
    from peer.cli import _load_engine
    from peer.config import PeerConfig

    engine = FakeEngine()
    monkeypatch.setattr("peer.engine.engine.load_engine", lambda *a, **k: engine)

    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    assert _load_engine(PeerConfig(model="tiny-random")) is engine
    assert engine.warmed_up
    warm = [line for line in err.getvalue().splitlines() if "warm" in line]
    assert len(warm) == 2 and "\r" not in err.getvalue()

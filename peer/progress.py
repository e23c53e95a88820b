"""Stage lines and a progress bar on stderr for slow start-up work (model conversion,
loading, the engine's warm-up).

    with stage("converting GGUF tensors (once)"):
        ...            # transformers draws its own per-tensor bar meanwhile

prints `prefixswarm: converting GGUF tensors (once)...` and, when the block ends,
`prefixswarm: converting GGUF tensors (once): done in 11.2 s`.

    bar = Bar("warm-up")
    bar.update(3, 10, "decode")  # prefixswarm: warm-up [#########.........] 3/10 decode
    bar.close()

redraws one line in place (carriage return) on a terminal, and draws nothing at all when
the stream is not a terminal (a log file or a pipe would only collect redraws), so there
the stage lines alone say what happened.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

BAR_WIDTH = 30
BAR_MIN_INTERVAL_S = 0.1  # redraws closer together than this are skipped (except the last)


@contextmanager
def stage(
    name: str, *, out: TextIO | None = None, clock: Callable[[], float] = time.perf_counter
) -> Iterator[None]:
    stream = out if out is not None else sys.stderr
    print(f"prefixswarm: {name}...", file=stream, flush=True)
    start = clock()
    yield
    print(f"prefixswarm: {name}: done in {clock() - start:.1f} s", file=stream, flush=True)


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is an interactive terminal (False for files, pipes, closed streams)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def render_bar(name: str, done: int, total: int, label: str = "", width: int = BAR_WIDTH) -> str:
    """One line of the bar: `prefixswarm: NAME [####......]  done/total label`."""
    total = max(total, 1)
    done = min(max(done, 0), total)
    filled = width * done // total
    count = f"{done:>{len(str(total))}}/{total}"
    tail = f" {label}" if label else ""
    return f"prefixswarm: {name} [{'#' * filled}{'.' * (width - filled)}] {count}{tail}"


class Bar:
    """A one-line progress bar, redrawn in place on a terminal; silent when `out` (stderr
    by default) is not a terminal or `enabled` is False."""

    def __init__(
        self,
        name: str,
        *,
        out: TextIO | None = None,
        enabled: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.name = name
        self.out = out if out is not None else sys.stderr
        self.enabled = is_terminal(self.out) if enabled is None else enabled
        self._clock = clock
        self._last_draw: float | None = None
        self._width = 0  # of the last line drawn, to blank a longer one
        self.drawn = 0  # redraws so far (for tests)

    def update(self, done: int, total: int, label: str = "") -> None:
        """Show `done` of `total` units; `label` says what is being done now."""
        if not self.enabled:
            return
        now = self._clock()
        last = done >= total
        if not last and self._last_draw is not None and now - self._last_draw < BAR_MIN_INTERVAL_S:
            return
        line = render_bar(self.name, done, total, label)
        pad = " " * max(self._width - len(line), 0)
        self.out.write(f"\r{line}{pad}")
        self.out.flush()
        self._width = len(line)
        self._last_draw = now
        self.drawn += 1

    def close(self) -> None:
        """End the bar's line (only if one was drawn)."""
        if self.enabled and self.drawn:
            self.out.write("\n")
            self.out.flush()

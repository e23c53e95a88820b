"""Stage lines on stderr for slow start-up work (model conversion and loading).

    with stage("converting GGUF tensors (once)"):
        ...            # transformers draws its own per-tensor bar meanwhile

prints `prefixswarm: converting GGUF tensors (once)...` and, when the block ends,
`prefixswarm: converting GGUF tensors (once): done in 11.2 s`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO


@contextmanager
def stage(
    name: str, *, out: TextIO | None = None, clock: Callable[[], float] = time.perf_counter
) -> Iterator[None]:
    stream = out if out is not None else sys.stderr
    print(f"prefixswarm: {name}...", file=stream, flush=True)
    start = clock()
    yield
    print(f"prefixswarm: {name}: done in {clock() - start:.1f} s", file=stream, flush=True)

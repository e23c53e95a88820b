"""Every benchmark's result: JSON written to its --json file and printed on stdout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit_json(result: Any, path: str | Path | None) -> None:
    """Write `result` as indented JSON to `path` (its folder made if missing; None: not
    written) and print the same text."""
    text = json.dumps(result, indent=2)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    print(text)

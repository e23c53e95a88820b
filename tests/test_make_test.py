"""`make test` runs every test: the parallel part takes those not marked `serial`, the
serial part collects only the Makefile's SERIAL_TESTS files, so every marked test must
live in one of them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def serial_files() -> set[str]:
    match = re.search(r"^SERIAL_TESTS := (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match is not None, "the Makefile names no SERIAL_TESTS"
    return set(match.group(1).split())


def test_every_serial_test_is_in_a_file_the_serial_part_collects() -> None:
    marked = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").glob("test_*.py")
        if re.search(r"pytest\.mark\.serial\b", path.read_text())
    }
    assert marked, "no test is marked serial: drop the serial part and SERIAL_TESTS"
    assert marked <= serial_files(), f"marked serial but not in SERIAL_TESTS: {marked}"
    assert serial_files() <= marked, "SERIAL_TESTS names a file without serial tests"


def test_the_make_test_target_runs_both_parts() -> None:
    target = (ROOT / "Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert '-m "not serial"' in target and "-m serial $(SERIAL_TESTS)" in target

"""Attack code of bench.rogue's modes, one module per mode (bench/rogue.py registers them)."""

"""Attack code of bench.rogue's modes, one module per mode."""

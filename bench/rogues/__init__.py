"""Attack code of bench.rogue modes, one module per mode."""

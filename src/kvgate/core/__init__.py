"""The pure, synchronous scheduling core: no I/O, no clock, no global randomness."""

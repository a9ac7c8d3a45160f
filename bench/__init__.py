"""Benchmarks: ``python -m bench.offline``."""

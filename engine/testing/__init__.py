"""Engines for tests and benchmarks: the fake engine (no torch) and its step gate."""

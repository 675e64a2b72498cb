"""Benchmark scripts (SPEC §8), shipped as `syncsgd.benchmarks` and run by `syncsgd bench`."""

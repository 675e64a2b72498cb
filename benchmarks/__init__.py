"""Benchmark scripts: `python benchmarks/NAME.py --help`. Ratios in one run, never asserted."""

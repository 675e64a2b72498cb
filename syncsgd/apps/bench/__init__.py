"""Measuring code behind `syncsgd bench`; the scripts in benchmarks/ call it."""

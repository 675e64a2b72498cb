"""The tools built on the core: verify, the batch-size study, the cost model, the demo, bench."""

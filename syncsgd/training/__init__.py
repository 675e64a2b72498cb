"""Training: the configuration, the data, the step, the loop and its instruments."""

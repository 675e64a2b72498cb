"""The model: an MLP in one flat parameter buffer, its Numba kernels, and the optimizer."""

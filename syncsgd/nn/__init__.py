"""The model: a Network of layers and a loss in one flat parameter buffer (network.py; the
--hidden MLP is one, mlp.py), the layers and losses (layers/, losses.py), the passes through
them in every mode and precision (local.py drives them: backprop.py, numerics.py, exact.py,
precision.py, kernels.py, blas.py), and the optimizers (optim/)."""

"""flatten: (C, H, W) -> (C·H·W,) in C, H, W order, as torch.nn.Flatten; a copy either way."""

from __future__ import annotations

import numpy as np

from syncsgd.nn.arrays import shape_size
from syncsgd.nn.layers.base import Layer, Primitives, Shape


class Flatten(Layer):
    """One sample's values in one row, as torch.nn.Flatten (C, H, W order)."""

    kind = "flatten"
    signature = "flatten"

    def output_shape(self, in_shape: Shape, outputs: int, last: bool) -> Shape:
        """(C·H·W,)."""
        return (shape_size(in_shape),)

    def forward_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> None:  # fmt: skip
        """y = x, one row per sample."""
        y[...] = x.reshape(y.shape)

    def backward_input_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:  # fmt: skip
        """dx = dy, in the input's shape."""
        dx[...] = dy.reshape(dx.shape)

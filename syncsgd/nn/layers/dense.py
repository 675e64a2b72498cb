"""dense(width): y = x W^T + b on the last axis, W of shape (width, in), as torch.nn.Linear.

A --hidden MLP stores W transposed, (in, width) (`in_out`): the same sums, y = x W + b; and
starts it by its own recipe (`init`): He-normal ("he") or Glorot-uniform ("glorot"), zero biases.
"""

from __future__ import annotations

import numpy as np

from syncsgd.nn.arrays import shape_size
from syncsgd.nn.layers.base import IDENTITY, RELU, Layer, Param, Primitives, Shape, rows


class Dense(Layer):
    """A fully connected layer; a last dense without a width gets the loss's width."""

    kind = "dense"
    signature = "dense(width)"

    def __init__(self, width: int | None = None, in_out: bool = False,
                 init: str | None = None) -> None:  # fmt: skip
        super().__init__()
        if width is not None and width < 1:
            raise ValueError(f"dense({width}): the width must be >= 1")
        self.width, self.in_out, self.init = width, in_out, init
        self.positions = 1  # rows per sample (output_shape sets it)
        self.activation = IDENTITY  # RELU: the relu after it, applied in its passes (absorb)

    def output_shape(self, in_shape: Shape, outputs: int, last: bool) -> Shape:
        """The input's leading axes, then the width."""
        if self.width is None and not last:
            raise ValueError("dense needs a width, e.g. dense(64), unless it is the last layer")
        self.positions = shape_size(in_shape[:-1])  # 1, or the positions of a sequence
        return (*in_shape[:-1], self.width or outputs)

    def params(self) -> list[Param]:
        """weight (out, in) and bias (out,), both U(±1/sqrt(in)) as PyTorch starts them; with
        `init`, the weight N(0, 2/in) ("he") or U(±sqrt(6/(in + out))) ("glorot"), the bias 0."""
        fan_in, fan_out = self.in_shape[-1], self.out_shape[-1]
        bound = 1.0 / np.sqrt(fan_in)
        shape = (fan_in, fan_out) if self.in_out else (fan_out, fan_in)
        if self.init == "he":
            return [Param("weight", shape, "scaled", np.sqrt(2.0 / fan_in)),
                    Param("bias", (fan_out,), "zeros")]  # fmt: skip
        if self.init == "glorot":
            return [Param("weight", shape, "uniform", np.sqrt(6.0 / (fan_in + fan_out))),
                    Param("bias", (fan_out,), "zeros")]  # fmt: skip
        return [Param("weight", shape, "uniform", bound),
                Param("bias", (fan_out,), "uniform", bound)]  # fmt: skip

    def absorb(self, following: Layer) -> bool:
        """A relu right after it is applied in its own passes (one pass fewer each way)."""
        if following.kind != "relu":
            return False
        self.activation = RELU
        return True

    def forward_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> None:  # fmt: skip
        """y = round(x W^T + b): the bias after the product, one rounding (a fused addmm); then
        the absorbed relu."""
        nx.affine_(rows(x, self.in_shape[-1]), p["weight"], p["bias"], rows(y, self.out_shape[-1]),
                   not self.in_out, self.activation)  # fmt: skip

    def backward_sums_(self, nx: Primitives, p: dict[str, np.ndarray], g: dict[str, np.ndarray],
                       x: np.ndarray, y: np.ndarray, dy: np.ndarray) -> None:  # fmt: skip
        """g.weight += dy^T x, g.bias += column sums of dy (dy first through the absorbed relu,
        in place)."""
        # positions: rows per sample; each element's sum has B x positions terms
        width = self.out_shape[-1]
        nx.affine_sums_(self.position, rows(x, self.in_shape[-1]), rows(dy, width), g["weight"],
                        g["bias"], self.in_out, self.positions, rows(y, width),
                        self.activation)  # fmt: skip

    def backward_input_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:  # fmt: skip
        """dx = round(dy W)."""
        below = rows(dx, self.in_shape[-1])
        nx.matmul_(rows(dy, self.out_shape[-1]), p["weight"], below, self.in_out)
        nx.round_(below)

    def model_width(self) -> int:
        """Its output features."""
        return self.out_shape[-1]

    def multiply_adds(self) -> int:
        """positions x in x out per sample."""
        return self.positions * self.in_shape[-1] * self.out_shape[-1]

    def describe(self) -> str:
        """dense(width)."""
        return f"dense({self.out_shape[-1]})" if self.out_shape else "dense"


"""dense(width): y = x W^T + b on the last axis, W of shape (width, in), as torch.nn.Linear.

A --hidden MLP stores W transposed, (in, width) (`in_out`): the same sums, y = x W + b; and
starts it by its own recipe (`init`): He-normal ("he") or Glorot-uniform ("glorot"), zero biases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit

from syncsgd.nn.arrays import shape_size
from syncsgd.nn.layers.base import IDENTITY, RELU, Layer, Param, Primitives, Shape, rows
from syncsgd.nn.numerics import Float, first_affine_sums_, float_affine_, float_matmul_

Plan = list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # per position: (x, y, dy)
# The two kinds of a chain's backward step: a dense layer's sums, the gradient at its input.
SUMS, INPUT = 0, 1


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


class DenseChain:
    """A network of dense layers alone (a relu after one absorbed by it) in float mode: each
    pass through all of them in one kernel call, the same kernels in the same order as the
    layers' own passes (the same bits), without a trip through Python per layer."""

    def __init__(self, dense: list[Dense], nx: Float) -> None:
        self.layers, self.nx = dense, nx
        self.positions = [layer.position for layer in dense]
        self.in_out = dense[0].in_out
        self.activations = np.array([layer.activation for layer in dense], np.int64)
        self._steps: dict[tuple[int, int], np.ndarray] = {}
        self._made_for: dict[int, tuple[Any, Any]] = {}

    @staticmethod
    def of(layers: list[Layer], absorbed: frozenset[int], nx: Primitives) -> DenseChain | None:
        """The chain of a network whose layers are all dense (or absorbed) in float mode in the
        model's dtype (the chain's kernels are that numerics' own), else None."""
        kept = [layer for layer in layers if layer.position not in absorbed]
        dense = [layer for layer in kept if type(layer) is Dense]
        if type(nx) is not Float or not kept or len(dense) != len(kept):
            return None
        if len({layer.in_out for layer in dense}) != 1:
            return None
        return DenseChain(dense, nx)

    def forward_(self, views: list[dict[str, np.ndarray]], inputs: np.ndarray,
                 plan: Plan) -> None:  # fmt: skip
        """Every layer's forward pass (as `Dense.forward_`), per position of `plan`'s (x, y, dy)."""
        weights, biases = self.arrays(views)
        outputs, _ = self.blocks(plan)
        chain_forward_(rows(inputs, self.layers[0].in_shape[-1]), weights, biases, outputs,
                       not self.in_out, self.activations)  # fmt: skip

    def backward_(self, views: list[dict[str, np.ndarray]], grads: list[dict[str, np.ndarray]],
                  inputs: np.ndarray, plan: Plan, top: int, bottom: int) -> None:  # fmt: skip
        """The backward pass through positions top down to bottom, as the passes take it layer
        by layer (`Dense.backward_input_`, then `backward_sums_`), the sums the first ones."""
        weights, _ = self.arrays(views)
        g_weights, g_biases = self.arrays(grads)
        outputs, deltas = self.blocks(plan)
        chain_backward_(self.steps(top, bottom), rows(inputs, self.layers[0].in_shape[-1]),
                        weights, outputs, deltas, g_weights, g_biases, self.in_out,
                        self.activations)  # fmt: skip

    def arrays(self, views: list[dict[str, np.ndarray]]) -> tuple[tuple[np.ndarray, ...], ...]:
        """(weights, biases) of the dense layers in order, from per-position views (made once
        per views' list)."""
        return self._made(views, lambda: tuple(
            tuple(views[position][name] for position in self.positions)
            for name in ("weight", "bias")))  # fmt: skip

    def blocks(self, plan: Plan) -> tuple[tuple[np.ndarray, ...], ...]:
        """(outputs, deltas) of the dense layers in order as (rows, width), from a plan's
        per-position (x, y, dy) (made once per plan)."""
        return self._made(plan, lambda: tuple(
            tuple(rows(plan[position][which], layer.out_shape[-1])
                  for position, layer in zip(self.positions, self.layers, strict=True))
            for which in (1, 2)))  # fmt: skip

    def _made(self, source: Any, make: Callable[[], Any]) -> Any:
        """make()'s result for this `source` object, made at its first call."""
        made = self._made_for.get(id(source))
        if made is None or made[0] is not source:
            if len(self._made_for) > 16:  # a caller handing fresh lists: keep none of the old
                self._made_for.clear()
            made = self._made_for[id(source)] = (source, make())
        return made[1]

    def steps(self, top: int, bottom: int) -> np.ndarray:
        """(kind, dense layer) of each step through positions top down to bottom: the gradient
        at the input of the dense layer above a position (unless it is absorbed, or the top),
        then the position's own sums (an absorbed layer has none)."""
        key = (top, bottom)
        if key not in self._steps:
            index = {position: k for k, position in enumerate(self.positions)}
            steps = []
            for position in range(top, bottom - 1, -1):
                if position + 1 in index:
                    steps.append((INPUT, index[position + 1]))
                if position in index:
                    steps.append((SUMS, index[position]))
            self._steps[key] = np.array(steps, np.int64).reshape(-1, 2)
        return self._steps[key]


@njit(nogil=True, cache=True)
def chain_forward_(inputs, weights, biases, outputs, transpose_b, activations):
    """outputs[k] = act_k(below W_k^T + b_k) (W_k unless transpose_b) of each dense layer k,
    below: the inputs, then the output of the layer before."""
    float_affine_(inputs, weights[0], biases[0], outputs[0], transpose_b, activations[0])
    for k in range(1, len(weights)):
        float_affine_(outputs[k - 1], weights[k], biases[k], outputs[k], transpose_b,
                      activations[k])  # fmt: skip


@njit(nogil=True, cache=True)
def chain_backward_(steps, inputs, weights, outputs, deltas, g_weights, g_biases, in_out,
                    activations):  # fmt: skip
    """Each step: the gradient at dense layer k's input into the delta of the layer below, or
    layer k's first sums (its delta through its activation first, in place)."""
    for step in range(steps.shape[0]):
        kind, k = steps[step, 0], steps[step, 1]
        if kind == INPUT:
            float_matmul_(deltas[k], weights[k], deltas[k - 1], in_out)
        elif k == 0:
            first_affine_sums_(inputs, deltas[0], g_weights[0], g_biases[0], in_out, outputs[0],
                               activations[0])  # fmt: skip
        else:
            first_affine_sums_(outputs[k - 1], deltas[k], g_weights[k], g_biases[k], in_out,
                               outputs[k], activations[k])  # fmt: skip

"""What every layer is: the parameters it owns, its output shape, its forward and backward pass.

A layer works on (m, *shape) blocks of samples and computes only with the primitives of the
numerics it is handed (syncsgd.nn.numerics), so every mode and precision works for every layer.
Its backward pass comes in two halves: `backward_sums_` ADDS the sums over the samples of its
parameters' gradients into the gradient views it is handed, and `backward_input_` writes the
gradient at its input for the layer below. The sums come first, so that --overlap can hand a
layer's bucket to its allreduce before the product that takes the gradient further down.
Numba is not imported here: the command line reads the layers' catalogue to build its help.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from syncsgd.nn.arrays import kept_zeros, scratch_zeros

Shape = tuple[int, ...]
# The element-wise function a layer's own passes apply to its output (an absorbed layer's).
IDENTITY, RELU = 0, 1


class Group(Protocol):
    """Whose values a sum or a peak is over: BatchNorm's statistics, exact mode's peaks."""

    training: bool
    eps: float
    momentum: float
    alone: bool  # True: this process's values are the group's (nothing crosses the ranks)

    def stats(self, position: Hashable, kind: Any, width: int) -> Any: ...

    def sum_(self, values: np.ndarray) -> None: ...

    def max_(self, values: np.ndarray) -> None: ...


class Primitives(Protocol):
    """What a layer computes with: nn/numerics.py implements them for every mode."""

    dtype: np.dtype  # of the activations and deltas
    group: Group  # BatchNorm's statistics group
    free_order: bool  # float mode: a layer may order its sums as it likes, in kernels of its own

    def matmul_(self, a: np.ndarray, b: np.ndarray, out: np.ndarray,
                transpose_b: bool) -> None: ...  # fmt: skip

    def affine_(self, a: np.ndarray, b: np.ndarray, bias: np.ndarray, out: np.ndarray,
                transpose_b: bool, activation: int = IDENTITY) -> None: ...  # fmt: skip

    def round_(self, values: np.ndarray) -> None: ...

    def scale_(self, delta: np.ndarray) -> None: ...

    def outer_sum_(self, layer: int, a: np.ndarray, b: np.ndarray, g: np.ndarray,
                   per_sample: int = 1) -> None: ...  # fmt: skip

    def column_sum_(self, layer: int, d: np.ndarray, g: np.ndarray,
                    per_sample: int = 1) -> None: ...  # fmt: skip

    def sparse_matmul_(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None: ...

    def sparse_outer_sum_(self, layer: int, a: np.ndarray, b: np.ndarray, g: np.ndarray,
                          per_sample: int = 1) -> None: ...  # fmt: skip

    def affine_sums_(self, layer: int, a: np.ndarray, d: np.ndarray, g_weight: np.ndarray,
                     g_bias: np.ndarray, a_first: bool, per_sample: int, y: np.ndarray,
                     activation: int = IDENTITY) -> None: ...  # fmt: skip

    def add_(self, g: np.ndarray, sums: np.ndarray) -> None: ...

    def agreed_sums_(self, kinds: tuple[int, ...], a: np.ndarray, b: np.ndarray, c: np.ndarray,
                     out: np.ndarray) -> None: ...  # fmt: skip

    def loss_sum(self, losses: np.ndarray, per_sample: int = 1) -> float: ...


@dataclass(frozen=True)
class Param:
    """One parameter array of a layer: its PyTorch name, its shape, how it starts."""

    name: str
    shape: Shape
    # "uniform" (±bound), "normal" (standard deviation bound), "scaled" (standard normal draws
    # times bound: the --hidden MLP's He-normal), "zeros" or "ones"
    init: str
    bound: float = 0.0

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        """Its first values, drawn in float64 (the same draws for every dtype)."""
        if self.init == "uniform":
            return rng.uniform(-self.bound, self.bound, size=self.shape)
        if self.init == "normal":
            return rng.normal(0.0, self.bound, size=self.shape)
        if self.init == "scaled":
            return rng.standard_normal(self.shape) * self.bound
        return np.full(self.shape, 1.0 if self.init == "ones" else 0.0)


class Layer:
    """The base of every layer type; a subclass sets `kind` and `signature`."""

    kind: ClassVar[str]  # its name in a --model spec
    signature: ClassVar[str]  # how a spec writes it, e.g. "dense(width)"
    # An element-wise layer may write its output over its input, and the gradient at its input
    # over the gradient at its output, unless the layer before it reads its own output backward.
    in_place: ClassVar[bool] = False
    reads_output: ClassVar[bool] = False  # backward_input_ reads y
    reads_tokens: ClassVar[bool] = False  # its input is token ids: never rounded to a format

    def __init__(self) -> None:
        self.position = 0  # in the network: the first part of its parameters' names
        self.name = ""  # inside another layer (a block's "ln1"): the prefix of its names
        self.in_shape: Shape = ()
        self.out_shape: Shape = ()

    def build(self, position: int, in_shape: Shape, outputs: int, last: bool) -> Shape:
        """Fix the per-sample input shape (`outputs`: the loss's width); returns the output's."""
        self.position, self.in_shape = position, in_shape
        self.out_shape = self.output_shape(in_shape, outputs, last)
        return self.out_shape

    def output_shape(self, in_shape: Shape, outputs: int, last: bool) -> Shape:
        """The per-sample output shape for this input (element-wise layers keep it)."""
        return in_shape

    def model_width(self) -> int:
        """The model width it sets (the Noam schedule's d): 0 for a layer that sets none."""
        return 0

    def params(self) -> list[Param]:
        """The parameter arrays it owns, in buffer order (none by default)."""
        return []

    def buffers(self) -> list[Param]:
        """The state it keeps beside the parameters (BatchNorm's running statistics), if any."""
        return []

    def absorb(self, following: Layer) -> bool:
        """Whether it applies the element-wise layer after it in its own passes (in place, on
        its output and the gradient at it): then the passes skip that layer. None by default."""
        return False

    def take_mask(self) -> bool:
        """Whether its backward pass can apply the mask of a relu before it (the gradient at its
        input 0 where that input is not positive): then it does from now on. No by default."""
        return False

    def hand_mask(self, following: Layer) -> bool:
        """Whether the layer after the relu it absorbed takes that relu's mask (`take_mask`):
        then its own backward pass skips the mask. No by default."""
        return False

    def forward_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> None:  # fmt: skip
        """y = the layer applied to x, sample by sample."""
        raise NotImplementedError

    def backward_sums_(self, nx: Primitives, p: dict[str, np.ndarray], g: dict[str, np.ndarray],
                       x: np.ndarray, y: np.ndarray, dy: np.ndarray) -> None:  # fmt: skip
        """g += the sums over the samples of its parameters' gradients (none by default)."""

    def backward_input_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:  # fmt: skip
        """dx = the gradient at x, from dy, the gradient at y."""
        raise NotImplementedError

    def multiply_adds(self) -> int:
        """Multiply-adds per sample of its forward product (0: it has none)."""
        return 0

    def describe(self) -> str:
        """How the spec would write this layer."""
        return self.kind

    def inner_size(self) -> int:
        """Values per sample it keeps beside its output during a pass (its workspaces)."""
        return 0

    def kept_bytes(self, m: int, itemsize: int) -> int:
        """Bytes it keeps beside its output from the forward pass for the backward pass, for m
        samples in a pass whose values take `itemsize` bytes (0 by default)."""
        return 0

    def scratch_bytes(self, m: int, itemsize: int) -> int:
        """Bytes of scratch its passes reuse, for m samples (0 by default)."""
        return 0

    def workspaces(self, nx: Primitives) -> Workspaces:
        """Its arrays for the passes of one numerics (one rank's threads share the layers)."""
        return nx.group.stats((self.position, self.name), Workspaces, 0)


class Workspaces:
    """A layer's arrays for one numerics (one rank's passes), each grown once to the largest."""

    def __init__(self, width: int = 0) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: Shape, dtype: Any) -> np.ndarray:
        """The first prod(shape) values of scratch `name`, shaped so; grown if too small."""
        return self._array(name, shape, dtype, scratch_zeros)

    def keep(self, name: str, shape: Shape, dtype: Any) -> np.ndarray:
        """As `get`, for values the forward pass keeps for the backward pass."""
        return self._array(name, shape, dtype, kept_zeros)

    def _array(self, name: str, shape: Shape, dtype: Any,
               zeros: Callable[[int, Any], np.ndarray]) -> np.ndarray:  # fmt: skip
        """Array `name`, made by `zeros` when missing or too small (memory.py tells the two
        makers apart)."""
        size = math.prod(shape)
        array = self._arrays.get(name)
        if array is None or array.size < size or array.dtype != np.dtype(dtype):
            array = self._arrays[name] = zeros(size, dtype)
        return array[:size].reshape(shape)


def rows(values: np.ndarray, width: int) -> np.ndarray:
    """A (samples x positions, width) view of an (m, ..., width) block."""
    return values.reshape(-1, width)

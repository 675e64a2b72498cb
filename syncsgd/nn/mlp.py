"""The MLP family: its shape, the layout of its one flat parameter buffer, and its init.

Layout: W0 (fan_in x fan_out, row-major), b0, W1, b1, ... packed in this order in one flat
contiguous buffer; gradients use the same layout, so the allreduce sums one buffer (fusion). With
BatchNorm every hidden layer's gamma{l}, beta{l} follow its b{l}. BatchNorm's running statistics
are state, not parameters: they live in a second flat buffer, running_mean{l}, running_var{l}.
Numba is not imported here: the CLI imports this module to build its parser.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from syncsgd.nn.arrays import checked, describe, shape_size
from syncsgd.nn.layers.base import Layer
from syncsgd.nn.losses import loss_entry
from syncsgd.nn.network import Network
from syncsgd.util.validate import DTYPES

ACTIVATIONS = ("relu", "tanh")
BATCHNORMS = ("none", "local", "sync")
_PARAM_NAME = re.compile(r"(?:W|b|gamma|beta)\d+")
_RUNNING_NAME = re.compile(r"running_(?:mean|var)\d+")


@dataclass(frozen=True)
class MLP:
    """Dense layers h = act(x W + b) with act on hidden layers only and a linear last layer;
    with BatchNorm, h = act(BN(x W + b)) on the hidden layers."""

    sizes: tuple[int, ...]  # (features, *hidden, outputs)
    activation: str = "relu"
    loss: str = "xent"
    dtype: np.dtype = field(default=np.dtype(np.float64))
    batchnorm: str = "none"  # none, local (each rank's shard) or sync (the global batch)

    def __post_init__(self) -> None:
        sizes = tuple(self.sizes)
        if len(sizes) < 2:
            raise ValueError(f"an MLP needs at least input and output sizes, got sizes={sizes}")
        for size in sizes:
            if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
                raise ValueError(f"layer sizes must be integers >= 1, got sizes={sizes}")
        object.__setattr__(self, "sizes", tuple(int(size) for size in sizes))
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r} (choose relu or tanh)")
        loss_entry(self.loss)  # a ValueError naming the losses
        if self.batchnorm not in BATCHNORMS:
            raise ValueError(f"unknown batchnorm {self.batchnorm!r} (choose none, local or sync)")
        try:
            dtype = np.dtype(self.dtype)
        except TypeError:
            raise ValueError(f"unknown dtype {self.dtype!r} (choose float64 or float32)") from None
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype} (choose float64 or float32)")
        object.__setattr__(self, "dtype", dtype)

    @property
    def n_layers(self) -> int:
        """Number of dense layers (hidden layers + 1)."""
        return len(self.sizes) - 1

    @functools.cached_property
    def n_params(self) -> int:
        """Length of the flat parameter buffer (computed once: the kernels' checks ask per call)."""
        return sum(shape_size(shape) for _, shape, _ in self.layout())

    def layer_shapes(self) -> list[tuple[int, int]]:
        """(fan_in, fan_out) of every dense layer, first to last."""
        return [(self.sizes[layer], self.sizes[layer + 1]) for layer in range(self.n_layers)]

    def param_names(self) -> list[str]:
        """Names of the parameter arrays in buffer order: W0, b0, W1, b1, ..."""
        return [name for name, _, _ in self.layout()]

    def layout(self) -> list[tuple[str, tuple[int, ...], int]]:
        """(name, shape, offset into the flat buffer) of every parameter array, in buffer order."""
        entries: list[tuple[str, tuple[int, ...], int]] = []
        offset = 0
        for layer, (fan_in, fan_out) in enumerate(self.layer_shapes()):
            arrays = [(f"W{layer}", (fan_in, fan_out)), (f"b{layer}", (fan_out,))]
            if self.normalised(layer):
                arrays += [(f"gamma{layer}", (fan_out,)), (f"beta{layer}", (fan_out,))]
            for name, shape in arrays:
                entries.append((name, shape, offset))
                offset += shape_size(shape)
        return entries

    def network(self) -> Network:
        """The same network as layers, its flat buffer laid out as this MLP's (W0, b0, ...)."""
        from syncsgd.nn.layers.batchnorm import BatchNorm
        from syncsgd.nn.layers.dense import Dense
        from syncsgd.nn.layers.relu import ReLU
        from syncsgd.nn.layers.tanh import Tanh

        layers: list[Layer] = []
        for layer, (_, fan_out) in enumerate(self.layer_shapes()):
            layers.append(Dense(fan_out, in_out=True))  # W of shape (fan_in, fan_out)
            if layer < self.n_layers - 1:
                layers += [BatchNorm()] if self.normalised(layer) else []
                layers.append(ReLU() if self.activation == "relu" else Tanh())
        spec = " ".join(layer.kind for layer in layers)
        return Network(spec, (self.sizes[0],), self.sizes[-1], self.loss, self.dtype, layers)

    def layer_of(self, name: str) -> int:
        """The dense layer a parameter array belongs to: W3, b3, gamma3, beta3 -> 3."""
        return layer_of(name)

    def normalised(self, layer: int) -> bool:
        """Whether `layer` normalises its outputs with BatchNorm (hidden layers, if any BN)."""
        return self.batchnorm != "none" and layer < self.n_layers - 1

    def running_layout(self) -> list[tuple[str, tuple[int, ...], int]]:
        """(name, shape, offset) of every running statistic in its flat buffer (empty: no BN)."""
        entries: list[tuple[str, tuple[int, ...], int]] = []
        offset = 0
        for layer, (_, fan_out) in enumerate(self.layer_shapes()):
            if self.normalised(layer):
                for name in (f"running_mean{layer}", f"running_var{layer}"):
                    entries.append((name, (fan_out,), offset))
                    offset += fan_out
        return entries

    @functools.cached_property
    def n_running(self) -> int:
        """Length of the flat buffer of running statistics (0 without BatchNorm)."""
        return sum(shape_size(shape) for _, shape, _ in self.running_layout())

    def init_running(self) -> np.ndarray:
        """The running statistics PyTorch starts from: every mean 0, every variance 1."""
        running = np.zeros(self.n_running, dtype=self.dtype)
        for name, shape, offset in self.running_layout():
            if name.startswith("running_var"):
                running[offset : offset + shape_size(shape)] = 1
        return running

    def running_views(self, running: np.ndarray) -> dict[str, np.ndarray]:
        """Views into the flat running statistics, named running_mean0, running_var0, ..."""
        if running.shape != (self.n_running,):
            raise ValueError(
                f"expected {self.n_running} running statistics, got {describe(running)}"
            )
        return {name: running[offset : offset + shape_size(shape)]
                for name, shape, offset in self.running_layout()}  # fmt: skip

    def running_from_arrays(self, arrays: Mapping) -> np.ndarray:
        """Running statistics from arrays keyed running_mean0, ...; the missing ones at default."""
        running = self.init_running()
        names = {name for name, _, _ in self.running_layout()}
        extra = sorted(k for k in arrays.keys() if _RUNNING_NAME.fullmatch(k) and k not in names)
        if extra:
            sizes = ",".join(map(str, self.sizes))
            raise ValueError(f"{extra[0]!r} does not belong to a model with batchnorm "
                             f"{self.batchnorm} and sizes {sizes}")  # fmt: skip
        views = self.running_views(running)
        for name, shape, _ in self.running_layout():
            if name in arrays:
                views[name][...] = checked(name, arrays[name], shape)
            if name.startswith("running_var") and np.any(views[name] < 0):
                raise ValueError(f"{name!r} holds a negative variance")
        return running

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Views (no copies) into `flat` named W0, b0, ...; writing to a view writes to `flat`."""
        if not isinstance(flat, np.ndarray) or flat.ndim != 1 or flat.shape[0] != self.n_params:
            raise ValueError(
                f"expected a flat array of {self.n_params} parameters, got {describe(flat)}"
            )
        if not flat.flags.c_contiguous:
            raise ValueError("the flat parameter buffer must be contiguous")
        return {
            name: flat[offset : offset + shape_size(shape)].reshape(shape)
            for name, shape, offset in self.layout()
        }

    def init_params(self, seed: int) -> np.ndarray:
        """Seeded parameters: He-normal (relu) or Glorot-uniform (tanh) weights, zero biases."""
        rng = np.random.default_rng(seed)
        flat = np.zeros(self.n_params, dtype=self.dtype)
        views = self.views(flat)
        # Every layer is drawn in float64, in order W0, W1, ..., then cast: the same draws for both
        # dtypes, so a float32 model starts from the rounded float64 one.
        for layer, (fan_in, fan_out) in enumerate(self.layer_shapes()):
            if self.activation == "relu":
                weights = rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)
            else:
                limit = np.sqrt(6.0 / (fan_in + fan_out))
                weights = rng.uniform(-limit, limit, size=(fan_in, fan_out))
            views[f"W{layer}"][...] = weights
            if self.normalised(layer):
                views[f"gamma{layer}"][...] = 1
        return flat

    def to_arrays(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Copies of the parameter arrays keyed W0, b0, ..., ready for np.savez."""
        return {name: view.copy() for name, view in self.views(flat).items()}

    def from_arrays(self, arrays: Mapping) -> np.ndarray:
        """A flat buffer in this model's dtype from arrays keyed W0, b0, ... (e.g. an .npz file)."""
        names = self.param_names()
        extra = sorted(k for k in arrays.keys() if _PARAM_NAME.fullmatch(k) and k not in names)
        if extra:
            raise ValueError(
                f"parameter {extra[0]!r} does not belong to a model with {self.n_layers} layers "
                f"(sizes {','.join(map(str, self.sizes))})"
            )
        flat = np.empty(self.n_params, dtype=self.dtype)
        views = self.views(flat)
        for name, shape, _ in self.layout():
            if name.startswith(("gamma", "beta")) and name not in arrays:  # saved without BN
                views[name][...] = 1 if name.startswith("gamma") else 0
                continue
            if name not in arrays:
                raise ValueError(f"missing parameter {name!r} (expected shape {shape})")
            views[name][...] = checked(name, arrays[name], shape)
        return flat


def layer_of(name: str) -> int:
    """The dense layer a parameter array belongs to: W3, b3, gamma3, beta3 -> 3."""
    return int(name.lstrip(string.ascii_letters))


def parse_hidden(text: str) -> tuple[int, ...]:
    """Hidden layer sizes from a comma-separated list: '64,64' -> (64, 64), '' -> ()."""
    if not text.strip():
        return ()
    sizes = []
    for part in text.split(","):
        part = part.strip()
        if not (part.isascii() and part.isdigit()) or int(part) < 1:
            raise ValueError(
                f"hidden layer sizes must be positive integers separated by commas "
                f"(e.g. 64,64 or '' for none), got {text!r}"
            )
        sizes.append(int(part))
    return tuple(sizes)

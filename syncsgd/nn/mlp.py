"""The --hidden MLP: a Network of dense layers, its init recipe, and its file format's names.

`mlp(sizes, ...)` is the network "dense(h1) [batchnorm] act ... dense(out)": every dense layer
stores W as (fan_in, fan_out) and starts it He-normal (relu) or Glorot-uniform (tanh), drawn in
float64 layer by layer, with zero biases (BatchNorm: gamma 1, beta 0). Its flat buffer is laid
out W0, b0, [gamma0, beta0,] W1, b1, ...; its arrays go by those names (a NameMap), and its
running statistics (with BatchNorm) by running_mean0, running_var0, ..., so --save, --init,
--resume and checkpoints read and write these keys and shapes. gamma{l}, beta{l} ride in the
bucket of their dense layer's W{l}, b{l}.
Numba is not imported here (only when `mlp` builds the layers): the CLI imports this module to
build its parser.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from syncsgd.nn.losses import loss_entry
from syncsgd.nn.network import NameMap, Network
from syncsgd.util.validate import DTYPES

ACTIVATIONS = ("relu", "tanh")
BATCHNORMS = ("none", "local", "sync")  # local: each rank's shard; sync: the global batch
_PARAM_NAME = re.compile(r"(?:W|b|gamma|beta)\d+")
_RUNNING_NAME = re.compile(r"running_(?:mean|var)\d+")


def mlp(sizes: Any, activation: str = "relu", batchnorm: str = "none", loss: str = "xent",
        dtype: Any = np.float64) -> Network:  # fmt: skip
    """The MLP of layer sizes (features, *hidden, outputs): h = act(x W + b) on the hidden
    layers (act(BN(x W + b)) with BatchNorm), a linear last layer, then the loss."""
    sizes = _checked_sizes(sizes)
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r} (choose relu or tanh)")
    loss_entry(loss)  # a ValueError naming the losses
    if batchnorm not in BATCHNORMS:
        raise ValueError(f"unknown batchnorm {batchnorm!r} (choose none, local or sync)")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"unknown dtype {dtype!r} (choose float64 or float32)") from None
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype} (choose float64 or float32)")
    layers = _layers(sizes, activation, batchnorm != "none")
    # its layers as --model would write them (which would start and store W as PyTorch does)
    spec = " ".join(f"dense({layer.width})" if layer.kind == "dense" else layer.kind
                    for layer in layers)  # fmt: skip
    return Network(spec, (sizes[0],), sizes[-1], loss, dtype, layers,
                   _name_map(layers, sizes, batchnorm))  # fmt: skip


def _checked_sizes(sizes: Any) -> tuple[int, ...]:
    """`sizes` as a tuple of Python ints >= 1, at least two of them, or a ValueError."""
    sizes = tuple(sizes)
    if len(sizes) < 2:
        raise ValueError(f"an MLP needs at least input and output sizes, got sizes={sizes}")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise ValueError(f"layer sizes must be integers >= 1, got sizes={sizes}")
    return tuple(int(size) for size in sizes)


def _layers(sizes: tuple[int, ...], activation: str, normalised: bool) -> list[Any]:
    """dense(fan_out) with W (fan_in, fan_out), [batchnorm,] relu|tanh per hidden layer; the
    last dense (importing the layers' modules: Numba)."""
    from syncsgd.nn.layers.batchnorm import BatchNorm
    from syncsgd.nn.layers.dense import Dense
    from syncsgd.nn.layers.relu import ReLU
    from syncsgd.nn.layers.tanh import Tanh

    init = "he" if activation == "relu" else "glorot"
    layers: list[Any] = []
    for fan_out in sizes[1:-1]:
        layers.append(Dense(fan_out, in_out=True, init=init))
        layers += [BatchNorm()] if normalised else []
        layers.append(ReLU() if activation == "relu" else Tanh())
    layers.append(Dense(sizes[-1], in_out=True, init=init))
    return layers


def _name_map(layers: list[Any], sizes: tuple[int, ...], batchnorm: str) -> NameMap:
    """W{l}, b{l}, gamma{l}, beta{l}, running_mean{l}, running_var{l} of dense layer l, for
    the "<position>.<name>" of its layers; each rides with its dense layer's position."""
    names, owners, optional = {}, {}, set()
    dense, owner = -1, 0
    for position, layer in enumerate(layers):
        if layer.kind == "dense":
            dense, owner = dense + 1, position
            own = {"weight": f"W{dense}", "bias": f"b{dense}"}
        elif layer.kind == "batchnorm":
            own = {"weight": f"gamma{dense}", "bias": f"beta{dense}",
                   "running_mean": f"running_mean{dense}", "running_var": f"running_var{dense}"}
            optional |= {own["weight"], own["bias"]}  # a file saved without BatchNorm: 1, 0
        else:
            continue
        for name, named in own.items():
            names[f"{position}.{name}"], owners[named] = named, owner
    joined = ",".join(map(str, sizes))
    return NameMap(names, owners, frozenset(optional), _PARAM_NAME, _RUNNING_NAME,
                   f"a model with {len(sizes) - 1} layers (sizes {joined})",
                   f"a model with batchnorm {batchnorm} and sizes {joined}")  # fmt: skip


def sizes_of(network: Network) -> tuple[int, ...]:
    """The layer sizes (features, *hidden, outputs) of an MLP: its input and dense widths."""
    return (*network.in_shape, *(layer.out_shape[-1] for layer in network.layers
                                 if layer.kind == "dense"))  # fmt: skip


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


__all__ = ["ACTIVATIONS", "BATCHNORMS", "mlp", "parse_hidden", "sizes_of"]

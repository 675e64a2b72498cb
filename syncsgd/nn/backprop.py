"""The forward and backward passes of a network over one shard, with workspaces allocated once.

    forward_loss_    x_0 = the inputs, x_{l+1} = layer_l(x_l), losses and the logits' delta
    backward_        layers top down to bottom: each ADDS its parameters' gradient sums and
                     writes the gradient at its input, which the layer below reads
Every layer's output and the gradient at it have workspaces of their own (exact mode extracts
its sums after the whole pass, from the values it left there). One instance per thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from syncsgd.nn.arrays import describe, shape_size
from syncsgd.nn.kernels import check_count, first_load, label_range
from syncsgd.nn.layers.dense import DenseChain
from syncsgd.nn.losses import loss_entry, make_loss
from syncsgd.nn.network import Network
from syncsgd.nn.numerics import Float, LocalGroup, Numerics

EVALUATE_CHUNK = 1024  # samples per forward pass in `evaluate`


class Placed(NamedTuple):
    """A network's arrays in buffers of their own rather than one flat buffer: per layer, its
    arrays' views, and what makes a layer's ready before the passes read it (a sharded step's
    buckets under way: parameters gathered, gradient sums written)."""

    views: list[dict[str, np.ndarray]]
    ready_: Callable[[int], None]


def no_wait(position: int) -> None:
    """Every layer's arrays are always there."""


class Backprop:
    """Loss and gradient sums of a network over a micro-batch of at most `max_batch` samples."""

    def __init__(self, network: Network, max_batch: int, nx: Numerics) -> None:
        self.network, self.nx = network, nx
        self.max_batch = check_count("max_batch", max_batch, low=0)
        self.loss = make_loss(network.loss)
        self.labels = loss_entry(network.loss).labels  # integer labels, else target rows
        self._inputs = np.zeros(self.max_batch * shape_size(network.in_shape), nx.dtype)
        self._outputs, self._grads = self._workspaces(nx.dtype)
        self.positions = shape_size(network.layers[-1].out_shape[:-1])  # loss terms per sample
        self._losses = np.zeros(self.max_batch * self.positions, np.float64)
        # (buffer, running, views) by the buffers' ids: the step hands the same buffers each time
        self._views: dict[tuple, tuple[Any, Any, list[dict[str, np.ndarray]]]] = {}
        self._plans: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self._weights: np.ndarray | Placed | None = None
        self._running: np.ndarray | None = None
        self._plan: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.m = 0  # samples of the pass under way
        # A network of dense layers alone, in float mode: each pass one kernel call (same bits)
        self.chain = DenseChain.of(network.layers, network.absorbed, nx)

    def _workspaces(self, dtype: np.dtype) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per layer, where its output and the gradient at it live: a buffer of its own, or
        its input's for an element-wise layer after one whose backward pass needs no output."""
        outputs: list[np.ndarray] = []
        grads: list[np.ndarray] = []
        layers = self.network.layers
        for position, layer in enumerate(layers):
            if position > 0 and layer.in_place and not layers[position - 1].reads_output:
                outputs.append(outputs[-1])
                grads.append(grads[-1])
                continue
            outputs.append(np.zeros(self.max_batch * shape_size(layer.out_shape), dtype))
            grads.append(np.zeros_like(outputs[-1]))
        return outputs, grads

    def forward_loss_(self, params: np.ndarray | Placed, X: np.ndarray, y: np.ndarray,
                      running: np.ndarray | None = None) -> tuple[float, int]:  # fmt: skip
        """The forward pass and the per-sample losses; (loss sum, hits); the logits' delta.

        `running`: the running statistics, which batchnorm layers update (training) or use."""
        X, y = self.checked(params, X, y)
        self.m = m = X.shape[0]
        weights = params if isinstance(params, Placed) else self.nx.weights(params)
        self._weights, self._running = weights, running
        views = self.views(weights, running)
        ready_ = weights.ready_ if isinstance(weights, Placed) else no_wait
        self._plan = plan = self._plan_for(m, self.inputs_(X))
        if self.chain is None or ready_ is not no_wait:
            self._layers_forward_(views, plan, ready_)
        elif first_load.armed is None:
            self.chain.forward_(views, plan[0][0], plan)
        else:
            with first_load.timing():  # the first call compiles or loads the kernels: say so
                self.chain.forward_(views, plan[0][0], plan)
        losses = self._losses[: m * self.positions]
        _, logits, delta = plan[-1]
        correct = self.loss.forward_delta_(self.nx, logits, y, delta, losses)
        return self.nx.loss_sum(losses, self.positions), correct

    def _layers_forward_(self, views: list[dict[str, np.ndarray]],
                         plan: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                         ready_: Callable[[int], None]) -> None:  # fmt: skip
        """Each layer's forward pass in turn (an absorbed one's is the layer before's)."""
        absorbed = self.network.absorbed
        for layer, (x, out, _) in zip(self.network.layers, plan, strict=True):
            if layer.position in absorbed:  # the layer before it applied it
                continue
            ready_(layer.position)
            if first_load.armed is None:
                layer.forward_(self.nx, views[layer.position], x, out)
                continue
            with first_load.timing():  # the first call compiles or loads the kernels: say so
                layer.forward_(self.nx, views[layer.position], x, out)

    def inputs_(self, X: np.ndarray) -> np.ndarray:
        """The shard's inputs as the passes read them; token ids copied as they are (a format
        would round ids above its integers)."""
        if not self.network.layers[0].reads_tokens:
            return self.nx.inputs_(X, self._inputs)
        tokens = self._inputs[: X.size].reshape(X.shape)
        tokens[...] = X
        return tokens

    def backward_(self, grads: np.ndarray | Placed, top: int, bottom: int) -> None:
        """Layers top down to bottom: each takes the gradient at its output from the layer above,
        then adds its sums into `grads`; a call ends with the bottom layer's sums."""
        assert self._weights is not None, "backward_ follows forward_loss_"
        views, grad_views = self.views(self._weights, self._running), self.views(grads)
        ready_ = self._weights.ready_ if isinstance(self._weights, Placed) else no_wait
        sums_ready_ = grads.ready_ if isinstance(grads, Placed) else no_wait
        layers, plan, nx = self.network.layers, self._plan, self.nx
        if self.chain is not None and ready_ is sums_ready_ is no_wait and self.chain.nx.first_sums:
            self.chain.backward_(views, grad_views, plan[0][0], plan, top, bottom)
            return
        absorbed = self.network.absorbed
        for position in range(top, bottom - 1, -1):
            above = position + 1
            # the loss gave the last layer's; an absorbed layer's is its absorber's to take
            if above < len(layers) and above not in absorbed:
                ready_(above)
                layers[above].backward_input_(nx, views[above], *plan[above], plan[position][2])
            ready_(position)
            sums_ready_(position)
            layers[position].backward_sums_(nx, views[position], grad_views[position],
                                            *plan[position])  # fmt: skip

    def _plan_for(self, m: int, inputs: np.ndarray) -> list[tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]]:  # fmt: skip
        """Per layer, (x, y, dy) for m samples: its input, output and the gradient at it."""
        if m not in self._plans:
            shapes = [layer.out_shape for layer in self.network.layers]
            outputs = [_block(out, m, shape) for out, shape in zip(self._outputs, shapes,
                                                                   strict=True)]  # fmt: skip
            grads = [_block(grad, m, shape) for grad, shape in zip(self._grads, shapes,
                                                                 strict=True)]  # fmt: skip
            self._plans[m] = [(inputs, y, dy) for y, dy in zip(outputs, grads, strict=True)]
            for position in range(1, len(outputs)):
                self._plans[m][position] = (outputs[position - 1], *self._plans[m][position][1:])
        plan = self._plans[m]
        if plan[0][0] is not inputs:  # the first layer reads this call's inputs
            plan[0] = (inputs, *plan[0][1:])
        return plan

    def views(self, flat: np.ndarray | Placed,
              running: np.ndarray | None = None) -> list[dict[str, np.ndarray]]:  # fmt: skip
        """Per layer, the views of its arrays in `flat` (and `running`), made once per buffer."""
        key = (id(flat), id(running))
        made = self._views.get(key)
        if made is None or made[0] is not flat or made[1] is not running:  # a new buffer
            if len(self._views) > 8:  # a caller handing fresh buffers: keep none of the old
                self._views.clear()
            made = self._views[key] = (flat, running, self._layer_views(flat, running))
        return made[2]

    def _layer_views(self, flat: np.ndarray | Placed,
                     running: np.ndarray | None) -> list[dict[str, np.ndarray]]:  # fmt: skip
        """Per layer, its arrays' views: in the flat buffer, or where they are placed."""
        if not isinstance(flat, Placed):
            return self.network.layer_views(flat, running)
        per_layer = [dict(views) for views in flat.views]
        if running is not None:  # the running statistics stay in their own flat buffer
            for views, statistics in zip(per_layer, self.network.running_layer_views(running),
                                         strict=True):  # fmt: skip
                views.update(statistics)
        return per_layer


    def checked(self, params: np.ndarray | Placed, X: np.ndarray,
                y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """X and y as the passes need them, or a ValueError."""
        network = self.network
        if isinstance(params, Placed):  # a sharded step's buckets: its own to get right
            pass
        elif not isinstance(params, np.ndarray) or params.shape != (network.n_params,) or (
                params.dtype != network.dtype):  # fmt: skip
            raise ValueError(f"params must be a {network.dtype} array of shape "
                             f"({network.n_params},), got {describe(params)}")  # fmt: skip
        X = np.ascontiguousarray(X, dtype=network.dtype)
        if X.ndim == 0 or X.size != len(X) * shape_size(network.in_shape):
            raise ValueError(f"X must have shape (m, {', '.join(map(str, network.in_shape))}), "
                             f"got {describe(X)}")  # fmt: skip
        if X.shape[1:] != network.in_shape:
            X = X.reshape(len(X), *network.in_shape)
        m = X.shape[0]
        if m > self.max_batch:
            raise ValueError(f"micro-batch of {m} samples exceeds max_batch={self.max_batch}")
        # The losses read y flat, without bounds checks: one label (or target row) per position.
        shape = (m, *network.layers[-1].out_shape[:-1])
        if self.labels:
            y_array = np.asarray(y)
            integers = y_array.size == 0 or y_array.dtype.kind in "biu"
            if y_array.size != shape_size(shape) or not integers:
                raise ValueError(f"labels must be an integer array of shape {shape}, got "
                                 f"{describe(y_array)}")  # fmt: skip
            y = np.ascontiguousarray(y_array, dtype=np.int64)
            low, high = label_range(y.reshape(-1)) if m else (0, 0)
            if low < 0 or high >= network.outputs:
                raise ValueError(f"labels must lie in [0, {network.outputs}), got "
                                 f"{low}..{high}")  # fmt: skip
        else:
            y = np.ascontiguousarray(y, dtype=network.dtype)
            if y.size != shape_size(shape) * network.outputs:
                raise ValueError(f"targets must have shape {(*shape, network.outputs)}, got "
                                 f"{describe(y)}")  # fmt: skip
        return X, y


def _block(workspace: np.ndarray, m: int, shape: tuple[int, ...]) -> np.ndarray:
    """The first m samples of a workspace, shaped (m, *shape)."""
    return workspace[: m * shape_size(shape)].reshape(m, *shape)


def evaluate(network: Network, params: np.ndarray, X: np.ndarray, y: np.ndarray,
             running: np.ndarray | None = None, eps: float = 1e-5) -> tuple[float, float]:
    """(mean loss, accuracy) over all samples in float mode, batchnorm with the running
    statistics; accuracy is nan for mse."""
    n_samples = len(X)
    if n_samples == 0:
        raise ValueError("evaluate needs at least one sample")
    chunk = min(n_samples, EVALUATE_CHUNK)
    nx = Float(network.dtype, 0, LocalGroup(training=False, eps=eps))
    passes = Backprop(network, chunk, nx)
    if running is None:
        running = network.init_running()
    loss_sum, correct = 0.0, 0
    for start in range(0, n_samples, chunk):
        rows = slice(start, start + chunk)
        part_loss, part_correct = passes.forward_loss_(params, X[rows], y[rows], running)
        loss_sum, correct = loss_sum + part_loss, correct + part_correct
    terms = n_samples * passes.positions
    accuracy = correct / terms if passes.labels else float("nan")
    return loss_sum / terms, accuracy

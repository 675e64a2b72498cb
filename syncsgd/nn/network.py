"""A network: a sequence of layers and a loss, built from a --model spec, in one flat buffer.

The spec: layers separated by spaces, each `name` or `name(args)` with positional integers and
key=value integers, e.g. "dense(64) relu dense(64) relu dense"; a last dense without a width gets
the number of classes (or outputs). Parameter arrays are named "<position in the spec>.<PyTorch
name>" with PyTorch's shapes, so the flat buffer's arrays are the state_dict of the nn.Sequential
of the matching modules (`to_arrays`, `from_arrays`). A network may carry a name map instead
(`NameMap`: the --hidden MLP's W0, b0, gamma0, ..., syncsgd.nn.mlp): its arrays then go by the
map's names everywhere outside the passes. The gradient uses the same layout: one fused
allreduce, or buckets of whole arrays.
Numba is not imported here: the command line checks a spec against the layers' catalogue.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from syncsgd.nn.arrays import checked, describe, shape_size
from syncsgd.nn.layers.base import Layer, Shape
from syncsgd.nn.losses import loss_entry
from syncsgd.nn.presets import expand, preset_help
from syncsgd.util.validate import DTYPES

LAYERS_DIR = Path(__file__).resolve().parent / "layers"
_TOKEN = re.compile(r"\s*([^\s(]+)(\(([^()]*)\))?")
_NAME = re.compile(r"[a-z][a-z0-9_-]*")
_PARAM_NAME = re.compile(r"\d+\.[A-Za-z_][A-Za-z0-9_.]*")


@dataclass(frozen=True)
class Entry:
    """One layer type of the catalogue: its spec name, signature, summary and home."""

    kind: str
    signature: str
    summary: str
    module: str
    cls: str

    @property
    def arguments(self) -> list[str]:
        """The names of its arguments, in order (`key=default` ones after the positional)."""
        inside = self.signature.partition("(")[2].rstrip(")")
        return [part.split("=")[0].strip() for part in inside.split(",") if part.strip()]


@functools.cache
def catalogue() -> dict[str, Entry]:
    """Every layer type, read from the sources of syncsgd/nn/layers without importing them."""
    entries = {}
    for path in sorted(LAYERS_DIR.glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            values = _class_constants(node)
            if "kind" in values and "signature" in values:
                assert isinstance(node, ast.ClassDef)
                summary = (ast.get_docstring(node) or "").split("\n")[0]
                entries[values["kind"]] = Entry(values["kind"], values["signature"], summary,
                                                path.stem, node.name)  # fmt: skip
    return entries


def _class_constants(node: ast.stmt) -> dict[str, Any]:
    """The `name = constant` assignments in a class body (empty for anything else)."""
    if not isinstance(node, ast.ClassDef):
        return {}
    values = {}
    for statement in node.body:
        if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Constant):
            for target in statement.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = statement.value.value
    return values


def layer_help() -> str:
    """Every layer type's signature and summary, then the presets."""
    layers = "; ".join(f"{entry.signature}: {entry.summary.rstrip('.')}"
                       for entry in catalogue().values())  # fmt: skip
    return f"{layers}. Presets: {preset_help()}"


@dataclass(frozen=True)
class Token:
    """One layer of a spec: its kind, positional and key=value arguments."""

    kind: str
    args: tuple[int, ...] = ()
    kwargs: tuple[tuple[str, int], ...] = ()
    text: str = ""


def parse_spec(spec: str) -> list[Token]:
    """The layers of a spec (presets expanded), checked against the catalogue; ValueError
    naming a bad token."""
    spec = expand(spec)
    tokens, position = [], 0
    known = catalogue()
    while spec[position:].strip():
        match = _TOKEN.match(spec, position)
        if match is None or spec[match.end() : match.end() + 1] == "(":  # "(" left open
            bad = spec[position:].split()[0]
            raise ValueError(f"--model: unbalanced parentheses in {bad!r}")
        position = match.end()
        text = match.group(0).strip()
        kind = match.group(1)
        if not _NAME.fullmatch(kind) or kind not in known:
            raise ValueError(f"--model: unknown layer {text!r} (layers: {', '.join(known)})")
        tokens.append(_arguments(known[kind], text, match.group(3)))
    if not tokens:
        raise ValueError("--model: the spec names no layer")
    return tokens


SPEC_INTEGER_MAX = 2**63 - 1  # the largest integer a spec may hold: NumPy's and Numba's int64


def spec_integer(text: str, value: str) -> int:
    """An integer argument of a spec, at most SPEC_INTEGER_MAX; ValueError naming `text`."""
    if not re.fullmatch(r"-?\d+", value):
        raise ValueError(f"--model: {text!r}: arguments are integers, got {value!r}")
    number = int(value)
    if abs(number) > SPEC_INTEGER_MAX:
        raise ValueError(f"--model: {text!r}: {value} is out of range (at most 2**63-1 in "
                         "magnitude)")  # fmt: skip
    return number


def _arguments(entry: Entry, text: str, inside: str | None) -> Token:
    """The token's arguments, checked against its signature."""
    args: list[int] = []
    kwargs: dict[str, int] = {}
    names = entry.arguments
    for part in (inside or "").split(","):
        key, equals, value = part.strip().rpartition("=")
        if not value and not equals and not key:
            if inside is not None and inside.strip():
                raise ValueError(f"--model: empty argument in {text!r}")
            continue
        number = spec_integer(text, value.strip())
        if equals:
            if key.strip() not in names:
                raise ValueError(f"--model: {text!r}: {entry.kind} has no argument "
                                 f"{key.strip()!r} ({entry.signature})")  # fmt: skip
            if key.strip() in kwargs or key.strip() in names[: len(args)]:
                raise ValueError(f"--model: {text!r}: {key.strip()} is given twice")
            kwargs[key.strip()] = number
        elif kwargs:
            raise ValueError(f"--model: {text!r}: positional argument after key=value")
        else:
            args.append(number)
    if len(args) > len(names):
        raise ValueError(f"--model: {text!r}: too many arguments ({entry.signature})")
    return Token(entry.kind, tuple(args), tuple(kwargs.items()), text)


def check_spec(flag: str, spec: str | None) -> str | None:
    """Why `spec` is not a valid --model spec, or None (an options check)."""
    if spec is None:
        return None
    try:
        parse_spec(spec)
    except ValueError as exc:
        return str(exc)
    return None


def make_layer(token: Token) -> Layer:
    """The layer a token names (importing its module: Numba)."""
    entry = catalogue()[token.kind]
    cls = getattr(importlib.import_module(f"syncsgd.nn.layers.{entry.module}"), entry.cls)
    try:
        return cls(*token.args, **dict(token.kwargs))
    except TypeError:
        raise ValueError(f"--model: {token.text!r} does not fit {entry.signature}") from None


@dataclass(frozen=True)
class NameMap:
    """A file format's own names for a network's arrays: its files keep their keys and shapes.

    `names` maps every "<position>.<name>" (parameters and running statistics) to the format's
    name; `owners` gives the position whose bucket an array rides in (the --hidden MLP's gamma1
    and beta1 ride with the W1, b1 of their dense layer); `optional` arrays may be missing from
    a file (they start as their layer starts them); a file's key that matches `params_pattern`
    (`running_pattern`) but names no array of the network is refused as not belonging to
    `params_owner` (`running_owner`), e.g. "a model with 2 layers (sizes 4,3,2)".
    """

    names: dict[str, str]
    owners: dict[str, int]
    optional: frozenset[str]
    params_pattern: re.Pattern[str]
    running_pattern: re.Pattern[str]
    params_owner: str
    running_owner: str


@dataclass
class Network:
    """Layers applied in order to (m, *in_shape) inputs, then the loss; one flat buffer."""

    spec: str
    in_shape: Shape
    outputs: int  # classes or outputs: the loss's width
    loss: str = "xent"
    dtype: np.dtype = field(default=np.dtype(np.float64))
    layers: list[Layer] = field(default_factory=list)  # built from the spec when not given
    name_map: NameMap | None = None  # None: the arrays go by "<position>.<PyTorch name>"
    absorbed: frozenset[int] = field(init=False, default=frozenset())  # positions the passes skip

    def __post_init__(self) -> None:
        loss_entry(self.loss)  # a ValueError naming the losses
        self.dtype = np.dtype(self.dtype)
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype} (choose float64 or float32)")
        if not self.layers:
            self.layers = [make_layer(token) for token in parse_spec(self.spec)]
        shape = tuple(self.in_shape)
        for position, layer in enumerate(self.layers):
            shape = layer.build(position, shape, self.outputs, position == len(self.layers) - 1)
            if shape_size(shape) > SPEC_INTEGER_MAX:
                raise ValueError(f"--model {self.spec!r}: {layer.describe()} gives each sample an "
                                 f"output of shape {shape}, more than 2**63-1 values")  # fmt: skip
        if shape[-1:] != (self.outputs,):
            raise ValueError(f"--model {self.spec!r} ends in shape {shape}: its last layer must "
                             f"give the {self.outputs} outputs of the loss")  # fmt: skip
        # A layer may take over the element-wise layer after it when the two share a buffer (it
        # writes over its own output, which its own backward pass does not read): those skipped.
        self.absorbed = frozenset(
            position + 1 for position, (layer, following) in
            enumerate(zip(self.layers[:-1], self.layers[1:], strict=True))
            if following.in_place and not layer.reads_output
            and layer.absorb(following))  # fmt: skip
        # The layer after an absorbed relu may apply the relu's mask in its backward pass (a
        # max-pool, from where its forward pass found the maxima): the absorber's skips it.
        for position in sorted(self.absorbed):
            if position + 1 < len(self.layers):
                self.layers[position - 1].hand_mask(self.layers[position + 1])
        # by "<position>.<PyTorch name>" for the passes, by their names for everything else
        self._own_layout = self._make_layout("params")
        self._own_running = self._make_layout("buffers")
        self._layout = [(self._named(name), shape, offset)
                        for name, shape, offset in self._own_layout]  # fmt: skip
        self._running = [(self._named(name), shape, offset)
                         for name, shape, offset in self._own_running]  # fmt: skip
        self.n_params = sum(shape_size(shape) for _, shape, _ in self._layout)

    # -- the flat buffer ---------------------------------------------------------------------

    def _make_layout(self, which: str) -> list[tuple[str, Shape, int]]:
        """(name, shape, offset) of every parameter (or buffer) array, layer by layer."""
        entries, offset = [], 0
        for layer in self.layers:
            for param in getattr(layer, which)():
                entries.append((f"{layer.position}.{param.name}", param.shape, offset))
                offset += shape_size(param.shape)
        return entries

    def _named(self, name: str) -> str:
        """The name an array goes by: the name map's, or its own "<position>.<name>"."""
        return name if self.name_map is None else self.name_map.names[name]

    def layout(self) -> list[tuple[str, Shape, int]]:
        """(name, shape, offset into the flat buffer) of every parameter array, in order."""
        return list(self._layout)

    @property
    def n_layers(self) -> int:
        """Layers in the spec: the backward pass runs positions n_layers - 1 down to 0."""
        return len(self.layers)

    def layer_of(self, name: str) -> int:
        """The spec position a parameter array belongs to: "3.weight" -> 3; with a name map,
        the position whose bucket it rides in (the --hidden MLP's gamma1: its dense layer's)."""
        if self.name_map is not None:
            return self.name_map.owners[name]
        return int(name.partition(".")[0])

    def param_names(self) -> list[str]:
        """Names of the parameter arrays in buffer order."""
        return [name for name, _, _ in self._layout]

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Views (no copies) into `flat` by name; writing to a view writes to `flat`."""
        if not self._checked_flat(flat).flags.c_contiguous:
            raise ValueError("the flat parameter buffer must be contiguous")
        return _views(flat, self._layout)

    def _checked_flat(self, flat: np.ndarray) -> np.ndarray:
        """`flat` if it is a 1-D array of n_params values, else a ValueError."""
        if not isinstance(flat, np.ndarray) or flat.ndim != 1 or flat.shape[0] != self.n_params:
            raise ValueError(
                f"expected a flat array of {self.n_params} parameters, got {describe(flat)}"
            )
        return flat

    def layer_views(self, flat: np.ndarray,
                    running: np.ndarray | None = None) -> list[dict[str, np.ndarray]]:  # fmt: skip
        """Per layer, its arrays' views by their PyTorch names ("weight", "running_mean", ...)."""
        per_layer: list[dict[str, np.ndarray]] = [{} for _ in self.layers]
        views = _views(self._checked_flat(flat), self._own_layout)
        if running is not None:
            views.update(_views(self._checked_running(running), self._own_running))
        for name, view in views.items():
            position, _, short = name.partition(".")
            per_layer[int(position)][short] = view
        return per_layer

    def running_layer_views(self, running: np.ndarray) -> list[dict[str, np.ndarray]]:
        """Per layer, its running statistics' views by their PyTorch names."""
        per_layer: list[dict[str, np.ndarray]] = [{} for _ in self.layers]
        for name, view in _views(self._checked_running(running), self._own_running).items():
            position, _, short = name.partition(".")
            per_layer[int(position)][short] = view
        return per_layer

    def placed_layer_views(self, place: Callable[[int, int], np.ndarray]
                           ) -> list[dict[str, np.ndarray]]:  # fmt: skip
        """Per layer, its parameter arrays' views where `place(offset, size)` puts each tensor
        of the flat layout (a sharded step's buffers of the buckets under way)."""
        per_layer: list[dict[str, np.ndarray]] = [{} for _ in self.layers]
        for name, shape, offset in self._own_layout:
            position, _, short = name.partition(".")
            per_layer[int(position)][short] = place(offset, shape_size(shape)).reshape(shape)
        return per_layer

    def init_params(self, seed: int) -> np.ndarray:
        """Seeded parameters as PyTorch starts its modules, drawn in float64 in buffer order."""
        rng = np.random.default_rng(seed)
        flat = np.zeros(self.n_params, dtype=self.dtype)
        views = _views(flat, self._own_layout)
        for layer in self.layers:
            for param in layer.params():
                views[f"{layer.position}.{param.name}"][...] = param.draw(rng)
        return flat

    def to_arrays(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Copies of the parameter arrays by name, ready for np.savez (a PyTorch state_dict)."""
        return {name: view.copy() for name, view in self.views(flat).items()}

    def from_arrays(self, arrays: Mapping) -> np.ndarray:
        """A flat buffer in this network's dtype from arrays by name (an .npz, a state_dict);
        with a name map, its optional arrays missing start as their layers start them."""
        mapped = self.name_map
        if mapped is None:
            names = {*self.param_names(), *(name for name, _, _ in self._running)}
            _refuse_extra(arrays, _PARAM_NAME, names, f"--model {self.spec!r}", "parameter ")
        else:
            _refuse_extra(arrays, mapped.params_pattern, set(self.param_names()),
                          mapped.params_owner, "parameter ")  # fmt: skip
        # an optional array missing starts as its layer starts it (gamma 1, beta 0: no draw)
        missing = mapped is not None and any(name not in arrays for name in mapped.optional)
        flat = self.init_params(0) if missing else np.empty(self.n_params, dtype=self.dtype)
        views = self.views(flat)
        for name, shape, _ in self._layout:
            if name not in arrays and mapped is not None and name in mapped.optional:
                continue  # saved without it (the MLP's gamma, beta: without BatchNorm)
            if name not in arrays:
                raise ValueError(f"missing parameter {name!r} (expected shape {shape})")
            views[name][...] = checked(name, arrays[name], shape)
        return flat

    # -- running statistics: a second flat buffer, "<position>.running_mean", ... --------------

    def running_layout(self) -> list[tuple[str, Shape, int]]:
        """(name, shape, offset) of every running statistic in its flat buffer (empty: none)."""
        return list(self._running)

    @property
    def n_running(self) -> int:
        """Length of the flat buffer of running statistics (0 without batchnorm)."""
        return sum(shape_size(shape) for _, shape, _ in self._running)

    def init_running(self) -> np.ndarray:
        """The running statistics PyTorch starts from: every mean 0, every variance 1."""
        running = np.zeros(self.n_running, dtype=self.dtype)
        views, rng = _views(running, self._own_running), np.random.default_rng(0)  # no draws
        for layer in self.layers:
            for buffer in layer.buffers():
                views[f"{layer.position}.{buffer.name}"][...] = buffer.draw(rng)
        return running

    def running_views(self, running: np.ndarray) -> dict[str, np.ndarray]:
        """Views into the flat running statistics by name."""
        return _views(self._checked_running(running), self._running)

    def _checked_running(self, running: np.ndarray) -> np.ndarray:
        """`running` if it holds n_running values, else a ValueError."""
        if running.shape != (self.n_running,):
            raise ValueError(
                f"expected {self.n_running} running statistics, got {describe(running)}"
            )
        return running

    def running_from_arrays(self, arrays: Mapping) -> np.ndarray:
        """Running statistics from arrays by name; the missing ones at their defaults."""
        if self.name_map is not None:
            _refuse_extra(arrays, self.name_map.running_pattern,
                          {name for name, _, _ in self._running}, self.name_map.running_owner)
        running = self.init_running()
        views = self.running_views(running)
        for (name, shape, _), (own, _, _) in zip(self._running, self._own_running, strict=True):
            if name in arrays:
                views[name][...] = checked(name, arrays[name], shape)
            if own.endswith("running_var") and np.any(views[name] < 0):
                raise ValueError(f"{name!r} holds a negative variance")
        return running

    # -- sizes -----------------------------------------------------------------------------------

    def activation_size(self) -> int:
        """Values per sample of every layer's output and workspaces."""
        return sum(shape_size(layer.out_shape) + layer.inner_size() for layer in self.layers)

    def largest_weight(self) -> int:
        """Elements of the largest parameter array."""
        return max((shape_size(shape) for _, shape, _ in self._layout), default=0)

    def largest_block(self) -> int:
        """Values per sample of the largest layer input or output."""
        return max(shape_size(shape) for layer in self.layers
                   for shape in (layer.in_shape, layer.out_shape))  # fmt: skip

    def multiply_adds(self) -> list[int]:
        """Per layer, the multiply-adds of its forward product per sample (0 for none)."""
        return [layer.multiply_adds() for layer in self.layers]

    def step_multiply_adds(self) -> tuple[int, int]:
        """(forward, backward) multiply-adds per sample of the layers' products."""
        # Backward, each product twice: the parameters' sums and the gradient at the layer's
        # input; the first layer's input needs none.
        products = self.multiply_adds()
        return sum(products), 2 * sum(products) - products[0]

    def summary(self) -> str:
        """The layers with their widths, e.g. "dense(64) relu dense(4)"."""
        return " ".join(layer.describe() for layer in self.layers)


def _views(flat: np.ndarray, layout: list[tuple[str, Shape, int]]) -> dict[str, np.ndarray]:
    """Views (no copies) into `flat` of the arrays of `layout`, by name."""
    return {name: flat[offset : offset + shape_size(shape)].reshape(shape)
            for name, shape, offset in layout}  # fmt: skip


def _refuse_extra(arrays: Mapping, pattern: re.Pattern[str], names: set[str], owner: str,
                  what: str = "") -> None:  # fmt: skip
    """A ValueError if a key of `arrays` looks like one of `pattern`'s but is not in `names`."""
    extra = sorted(k for k in arrays.keys() if pattern.fullmatch(k) and k not in names)
    if extra:
        raise ValueError(f"{what}{extra[0]!r} does not belong to {owner}")


def build(spec: str, in_shape: Shape, outputs: int, loss: str, dtype: Any) -> Network:
    """The network a spec describes for inputs of `in_shape` and `outputs` outputs."""
    return Network(spec, tuple(in_shape), outputs, loss, np.dtype(dtype))


__all__ = ["NameMap", "Network", "build", "catalogue", "check_spec", "layer_help", "parse_spec"]

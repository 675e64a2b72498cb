"""The optimizers: the protocol each follows, the registry --optimizer chooses from, and how one
is made; the learning-rate schedules and the clipping that all of them share.

An optimizer is one module here, declaring its options (dataclass fields made with
`syncsgd.util.options.option`, which TrainConfig takes as they are) and its class, plus one line
in OPTIMIZERS.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import fields
from typing import Any, Protocol

import numpy as np

from syncsgd.nn.optim.adam import Adam, AdamOptions, AdamW, AdamWOptions
from syncsgd.nn.optim.lamb import LAMB, LAMBOptions
from syncsgd.nn.optim.lars import LARS, LARSOptions
from syncsgd.nn.optim.schedule import (
    LR_SCALINGS,
    SCHEDULES,
    OptimConfig,
    clip_,
    global_norm,
    learning_rate,
)
from syncsgd.nn.optim.sgd import SGD, SGDOptions
from syncsgd.nn.optim.tensors import Layout
from syncsgd.util.options import options_of
from syncsgd.util.validate import choice


class Optimizer(Protocol):
    """An update of the flat parameters in place, whose state a checkpoint holds as arrays."""

    def step_(self, params: np.ndarray, grad: np.ndarray, step: int, *,
              want_norm: bool = True) -> dict[str, float]:  # fmt: skip
        """Update `params` with the mean gradient `grad` (overwritten); {"lr", "grad_norm"}."""
        ...

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Copies of the optimizer's state, by name, for a checkpoint."""
        ...

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore the state that `state_arrays` gave."""
        ...


class OptimizerClass(Protocol):
    """An optimizer's class: the dataclass of its options, and its constructor."""

    Options: type[Any]

    def __call__(self, config: OptimConfig, n_params: int, dtype: str | np.dtype,
                 options: Any = None, layout: Layout | None = None) -> Optimizer: ...  # fmt: skip


OPTIMIZERS: dict[str, OptimizerClass] = {
    "sgd": SGD, "adam": Adam, "adamw": AdamW, "lamb": LAMB, "lars": LARS,
}  # fmt: skip


def optimizer_class(name: str) -> OptimizerClass:
    """The class of optimizer `name` (ValueError naming the known ones if there is none)."""
    return OPTIMIZERS[choice("optimizer", name, tuple(OPTIMIZERS))]


def optimizer_options(name: str, settings: Any) -> Any:
    """Optimizer `name`'s options, read from the attributes of `settings` of the same names
    (a TrainConfig) and checked together (ValueError naming the flags)."""
    options_type = optimizer_class(name).Options
    for error in foreign_options(name, settings):
        raise ValueError(error)
    given = {field.name: getattr(settings, field.name) for field in fields(options_type)}
    return options_type(**given)


def foreign_options(name: str, settings: Any) -> Iterator[str]:
    """The options of the other optimizers that `settings` gives away from their defaults, each
    refused in one line naming its flag (e.g. --nesterov with adam)."""
    own = {field.name for field in fields(optimizer_class(name).Options)}
    seen = set(own)
    for other in OPTIMIZERS.values():
        defaults = {field.name: field.default for field in fields(other.Options)}
        for field_name, declared in options_of(other.Options):
            if field_name in seen or not hasattr(settings, field_name):
                continue
            seen.add(field_name)
            if getattr(settings, field_name) != defaults[field_name]:
                users = [key for key, cls in OPTIMIZERS.items() if has_field(cls, field_name)]
                yield (f"{declared.flag} does not apply to --optimizer {name} "
                       f"(only to {', '.join(users)})")  # fmt: skip


def has_field(cls: OptimizerClass, name: str) -> bool:
    """Whether optimizer class `cls` has option `name`."""
    return name in {field.name for field in fields(cls.Options)}


def make_optimizer(name: str, config: OptimConfig, n_params: int, dtype: str | np.dtype,
                   settings: Any = None, layout: Layout | None = None) -> Optimizer:  # fmt: skip
    """Optimizer `name` of `n_params` parameters of `dtype` under the schedule and clipping of
    `config`; its options read from `settings` (a TrainConfig), their defaults if None;
    `layout`: the model's (name, shape, offset) tensors, which LAMB and LARS scale one by one
    (None: one tensor of all the parameters)."""
    options = None if settings is None else optimizer_options(name, settings)
    if layout is None:
        return optimizer_class(name)(config, n_params, dtype, options)
    return optimizer_class(name)(config, n_params, dtype, options, layout=layout)


__all__ = [
    "LAMB",
    "LARS",
    "LR_SCALINGS",
    "OPTIMIZERS",
    "SCHEDULES",
    "SGD",
    "Adam",
    "AdamOptions",
    "AdamW",
    "AdamWOptions",
    "LAMBOptions",
    "LARSOptions",
    "Layout",
    "OptimConfig",
    "Optimizer",
    "SGDOptions",
    "clip_",
    "foreign_options",
    "global_norm",
    "learning_rate",
    "make_optimizer",
    "optimizer_class",
    "optimizer_options",
]

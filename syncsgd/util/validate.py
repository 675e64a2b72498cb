"""Checks of library arguments that raise one-line ValueErrors (shared by data and optim)."""

from __future__ import annotations

import operator

import numpy as np

DTYPES = (np.dtype(np.float64), np.dtype(np.float32))  # the float types a model computes in


def integer(name: str, value: int) -> int:
    """`value` as a Python int; ValueError for floats, bools and other non-integers."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, not {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, not {value!r}") from None


def float_dtype(dtype: str | np.dtype) -> np.dtype:
    """`dtype` as a NumPy dtype, float64 or float32 (None is refused, not read as float64)."""
    try:
        resolved = None if dtype is None else np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved not in DTYPES:
        raise ValueError(f"dtype must be float64 or float32, not {dtype!r}")
    return resolved


def choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    """`value` if it is one of `choices`, else a ValueError listing them."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}: expected one of {', '.join(choices)}")
    return value

"""What every model's arrays need: their sizes, checks and descriptions in messages.

The float types a model computes in are syncsgd.util.validate.DTYPES; the losses are
syncsgd.nn.losses' registry.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def checked(name: str, array: object, shape: tuple[int, ...]) -> np.ndarray:
    """`array` as a finite numeric array of `shape`, or a ValueError naming `name`."""
    value = np.asarray(array)
    if value.shape != shape:
        raise ValueError(f"parameter {name!r} has shape {value.shape}, expected {shape}")
    if value.dtype.kind not in "fiu":
        raise ValueError(f"parameter {name!r} has non-numeric dtype {value.dtype}")
    if not np.all(np.isfinite(value)):
        raise ValueError(f"parameter {name!r} contains NaN or infinity")
    return value


def shape_size(shape: tuple[int, ...]) -> int:
    """Number of elements of an array of this shape."""
    size = 1
    for extent in shape:
        size *= extent
    return size


def kept_zeros(size: int, dtype: Any) -> np.ndarray:
    """A zeroed array the forward pass fills and the backward pass reads (an activation)."""
    return np.zeros(size, dtype)


def scratch_zeros(size: int, dtype: Any) -> np.ndarray:
    """A zeroed array a pass writes and reads again within itself (a workspace)."""
    return np.zeros(size, dtype)


def describe(value: object) -> str:
    """A short description of an array-like for error messages."""
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    return f"a {type(value).__name__}"

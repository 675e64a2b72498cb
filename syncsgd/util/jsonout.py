"""JSON as the tool writes it: strict, null where a number is not finite (no NaN, no Infinity)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from syncsgd.util.files import write_text


def strict(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None, recursively; NumPy values as Python's."""
    if isinstance(obj, np.ndarray):
        obj = obj.tolist()
    elif isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {key: strict(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(value) for value in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """json.dumps of `strict(obj)`, refusing any NaN or Infinity left (`kwargs` as json.dumps's)."""
    return json.dumps(strict(obj), allow_nan=False, **kwargs)


def write(path: str | os.PathLike[str], obj: Any, indent: int | None = 1, **kwargs: Any) -> None:
    """Write `obj` as strict JSON and a newline to `path`, atomically."""
    write_text(path, dumps(obj, indent=indent, **kwargs) + "\n")

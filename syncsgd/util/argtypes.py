"""argparse value types that reject bad input with one clear line."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

Value = TypeVar("Value")


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def unit_fraction(text: str) -> float:
    """A number in [0, 1)."""
    value = finite_float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def finite_float(text: str) -> float:
    """A finite number (no NaN, no infinity)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def rank_list(text: str) -> list[int]:
    """A comma-separated list of positive integers, e.g. 1,2,3,4,8."""
    return comma_list(text, positive_int, "1,2,4")


def hidden_sizes(text: str) -> tuple[int, ...]:
    """Hidden layer widths: '64,64' -> (64, 64); '' -> () (no hidden layer)."""
    parts = [part.strip() for part in text.split(",")]
    if parts == [""]:
        return ()
    if not all(part.isascii() and part.isdigit() and int(part) >= 1 for part in parts):
        raise argparse.ArgumentTypeError(
            f"hidden layer sizes must be positive integers separated by commas "
            f"(e.g. 64,64 or '' for none), got {text!r}"
        )
    return tuple(int(part) for part in parts)


def dimensions(text: str) -> tuple[int, ...]:
    """A shape: positive integers separated by commas, '3,8,8' -> (3, 8, 8)."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isascii() and part.isdigit() and int(part) >= 1 for part in parts):
        raise argparse.ArgumentTypeError(
            f"a shape is positive integers separated by commas (e.g. 3,8,8), got {text!r}"
        )
    return tuple(int(part) for part in parts)


def dtype_list(text: str) -> list[str]:
    """float64,float32 -> ['float64', 'float32']: the float dtypes a model can have."""
    names = comma_separated(text)
    if not names or any(name not in ("float64", "float32") for name in names):
        raise argparse.ArgumentTypeError(f"dtypes must be float64 and/or float32, got {text!r}")
    return names


def comma_list(
    text: str, parse: Callable[[str], Value], example: str, what: str = "a list"
) -> list[Value]:
    """The entries of a comma-separated list, each read by `parse`; at least one."""
    values = [parse(part) for part in comma_separated(text)]
    if not values:
        raise argparse.ArgumentTypeError(f"expected {what} like {example}, got {text!r}")
    return values


def comma_separated(text: str) -> list[str]:
    """The entries of a comma-separated list, stripped; empty entries are dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]

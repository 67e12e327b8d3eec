"""Arguments of public entry points checked at the boundary, with one vocabulary of messages: a
count is an int (NumPy's integers included, bool not) in range, a callback is callable, an object
is of the type asked for. Each check returns the value as the code inside wants it (a count as a
Python int), so a wrong type never travels into a traced program to fail there."""

from collections.abc import Callable
from typing import Any

import numpy as np


def count(value: Any, name: str, *, low: int = 1) -> int:
    """`value` as an int >= `low`; a ValueError naming `name` and the value otherwise (a bool,
    a float such as 2.5 or 1.0, a string)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def optional_count(value: Any, name: str, *, low: int = 1) -> int | None:
    """`count(value)`, or None for None."""
    return None if value is None else count(value, name, low=low)


def callback(value: Any, name: str, signature: str) -> Callable | None:
    """`value` if it is callable or None; a ValueError saying what it should be otherwise."""
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be callable ({signature}) or None, got {value!r}")
    return value


def instance(value: Any, name: str, kind: type, example: str) -> Any:
    """`value` if it is a `kind`; a ValueError naming both types and how to get one."""
    if not isinstance(value, kind):
        raise ValueError(
            f"{name} must be a {kind.__name__} ({example}), not a {type(value).__name__}"
        )
    return value

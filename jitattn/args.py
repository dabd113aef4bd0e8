"""Checks of the plain Python arguments the public API shares (counts, sizes), so that every
wrapper refuses a bad one alike: TypeError for the wrong type, ValueError for the wrong value,
each naming the argument and its value."""

from __future__ import annotations

import operator

import numpy as np


def int_arg(name: str, value, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as a Python int: a Python or numpy int (not a bool, not a float that happens to
    be whole) in minimum .. maximum. Raises TypeError / ValueError naming ``name``."""
    expected = f"an int >= {minimum}" if maximum is None else f"an int in {minimum} .. {maximum}"
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}={value!r}: expected {expected}") from None
    if n < minimum or (maximum is not None and n > maximum):
        raise ValueError(f"{name}={value!r}: expected {expected}")
    return n


def bool_arg(name: str, value) -> bool:
    """``value`` as a Python bool: True / False, or numpy's. Raises TypeError naming ``name``
    for anything else (a string such as "no" would otherwise count as true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r}: expected True or False")
    return bool(value)

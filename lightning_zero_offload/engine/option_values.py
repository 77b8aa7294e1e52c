"""Type and range checks for settings, with messages that name the option (as the user spelled it)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any


def check_bool(name: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, bool):
        allowed = "True, False or None" if optional else "True or False"
        raise TypeError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")


def check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_real(name: str, value: Any, requirement: str, valid: bool | Callable[[float], bool] | None = None) -> None:
    """A finite real number (not a bool or a string) for which ``valid`` holds; ``requirement`` says what that is."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number {requirement}, got {value!r} ({type(value).__name__})")
    ok = valid(value) if callable(valid) else valid is None or valid  # a callable is only called on a number
    if not math.isfinite(value) or not ok:
        raise ValueError(f"{name} must be a finite number {requirement}, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")

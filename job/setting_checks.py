"""The small checks the training settings are made of: each raises a
:class:`SettingError` naming the field, with the fix in the message."""

from __future__ import annotations

from typing import Any

from isthmus.job.basics import FieldError, is_number


class SettingError(FieldError):
    """A training setting is invalid; ``field`` names it and the message gives the fix."""


def positive_int(name: str, value: Any) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise SettingError(name, f"must be an integer >= 1, got {value!r}")


def non_negative_int(name: str, value: Any, meaning: str) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise SettingError(name, f"must be an integer >= 0 ({meaning}), got {value!r}")


def positive_number(name: str, value: Any, what: str = "a number") -> None:
    if not (is_number(value) and value > 0):
        raise SettingError(name, f"must be {what} > 0, got {value!r}")


def fraction(name: str, value: Any) -> None:
    """In [0, 1): a decay or momentum."""
    if not (is_number(value) and 0 <= value < 1):
        raise SettingError(name, f"must be in [0, 1), got {value!r}")


def boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise SettingError(name, f"must be true or false, got {value!r}")


def one_of(name: str, value: Any, choices: tuple[str, ...], meaning: str) -> None:
    if value not in choices:
        raise SettingError(
            name, f"unknown value {value!r} ({meaning}); use one of {', '.join(choices)}"
        )

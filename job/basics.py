"""What every layer's checks share: one error base, one number check, the codec names.

They sit at the bottom because ``sim`` may not import ``inter`` (nor ``intra``),
and each layer validates its own settings: before this module each kept its own
copy of the same three things.
"""

from __future__ import annotations

import math
from typing import Any

CODECS = ("none", "fp16", "bf16", "int8", "int4", "int2")
"""The lossy stage of a codec, most precise first (a codec name may add ``+zstd``).
The tuner prefers the earlier one at equal H."""


class FieldError(ValueError):
    """A setting is invalid; ``field`` names it and the message gives the fix.

    The base of every layer's setting error (``SettingError``, ``LinkConfigError``,
    ``TuneError``), so one ``except`` catches any of them and the message is
    always ``field: reason``."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.reason = message


def is_number(value: Any, *, finite: bool = True) -> bool:
    """An int or float, not a bool (YAML's ``yes`` is not a number); with ``finite``,
    not NaN or infinite either."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    return not finite or math.isfinite(value)


__all__ = ["CODECS", "FieldError", "is_number"]


def finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, inf) made None, through lists, tuples
    and dicts: JSON has no NaN, and strict parsers refuse a file that writes one."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


def to_json(value: Any, *, indent: int | None = None, default: Any = None) -> str:
    """Strict JSON: non-finite floats written as null (:func:`finite_or_none`)."""
    import json

    return json.dumps(finite_or_none(value), indent=indent, default=default, allow_nan=False)

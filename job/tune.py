"""The job file's ``tune:`` section: what ``isthmus tune`` and the online controller
aim for and may choose. The reasoning that uses it is :mod:`isthmus.sim.tuner`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from isthmus.job.basics import CODECS, FieldError, is_number

LIVE_SYNC_EVERY = ("diloco", "async")
"""Strategies whose H can change while they run (the others fix it at the start)."""


class TuneError(FieldError):
    """A tuner setting is invalid; ``field`` names it and the message gives the fix."""


@dataclass(frozen=True, kw_only=True)
class TuneSettings:
    """The job file's ``tune:`` section: what the tuner aims for and may choose."""

    target_utilization: float = 0.9
    """Compute utilisation the chosen H must reach (the rest is exposed communication)."""
    price_per_gb: float = 0.05
    """WAN egress price, per GB sent, for the cost column (inter-region transfer is
    typically 0.02-0.09 in USD)."""
    codecs: tuple[str, ...] = ("none", "bf16", "int8", "int4", "int2")
    """Codecs the tuner may pick, the most precise that reaches the target first;
    ``int2`` (ternary, with error feedback) is the DiLoCo family's default, and left
    out the tuner could only ever move a job away from it."""
    min_sync_every: int = 5
    max_sync_every: int = 500
    """Bounds on H for the sweep and for the online controller."""
    online: bool = False
    """``isthmus run``: move H between rounds from the measured round times (``diloco`` and
    ``async``), through the control plane's config topic."""
    online_every_rounds: int = 2
    """The online controller decides at most once per this many outer rounds."""

    def __post_init__(self) -> None:
        if not (is_number(self.target_utilization) and 0 < self.target_utilization < 1):
            raise TuneError(
                "target_utilization",
                f"must be a fraction in (0, 1), e.g. 0.9, got {self.target_utilization!r}",
            )
        if not (is_number(self.price_per_gb) and self.price_per_gb >= 0):
            raise TuneError("price_per_gb", f"must be a number >= 0, got {self.price_per_gb!r}")
        if (
            not isinstance(self.codecs, list | tuple)
            or not self.codecs
            or any(not isinstance(c, str) or c not in CODECS for c in self.codecs)
        ):
            raise TuneError("codecs", f"list some of {', '.join(CODECS)}, got {self.codecs!r}")
        for name in ("min_sync_every", "max_sync_every", "online_every_rounds"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise TuneError(name, f"must be an integer >= 1, got {value!r}")
        if self.min_sync_every > self.max_sync_every:
            raise TuneError(
                "min_sync_every",
                f"{self.min_sync_every} is above max_sync_every {self.max_sync_every}",
            )
        if not isinstance(self.online, bool):
            raise TuneError("online", f"must be true or false, got {self.online!r}")


TUNE_KEYS = tuple(f.name for f in dataclasses.fields(TuneSettings))

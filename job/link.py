"""The model of one emulated WAN link: its parameters, per direction, and their validation.

One model of a link serves every backend of the emulator (today the TCP proxy;
later the packet router), so a link behaves the same whichever carries its
bytes. Parameters are per direction because real paths are often asymmetric
(an uplink cap, a congested return path); a link built with
:meth:`LinkParams.symmetric` uses the same values both ways.

Units are in the names: ``_ms``, ``_mbit`` (Mbit/s, 10**6 bits per second),
``_bytes``. Fractions (``loss``, ``corrupt``) are probabilities in [0, 1].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from isthmus.job.basics import FieldError, is_number

JITTER_DISTRIBUTIONS = ("normal", "uniform", "pareto")

# Linux's minimum retransmission timeout (TCP_RTO_MIN): a lost segment that
# fast retransmit cannot repair stalls the stream at least this long.
LINUX_MIN_RTO_MS = 200.0
# A typical Ethernet TCP segment's payload with timestamps (1500 - 20 - 20 - 12).
DEFAULT_MSS_BYTES = 1448
# Per-connection bytes in flight: the receive window a well-tuned long-fat TCP
# reaches. It bounds memory when the link itself is uncapped.
DEFAULT_WINDOW_BYTES = 16 * 1024 * 1024


class LinkConfigError(FieldError):
    """A link parameter is out of range; ``field`` names it, the message says the fix."""


@dataclass(frozen=True, kw_only=True)
class DirectionParams:
    """How one direction of a link treats the bytes that cross it."""

    delay_ms: float = 0.0
    """One-way propagation delay. A symmetric link uses rtt_ms / 2 each way."""

    jitter_ms: float = 0.0
    """Standard deviation of the one-way delay (for ``pareto``: the distribution's scale).
    Jitter never reorders the byte stream: a segment never overtakes the one before it."""

    jitter_distribution: str = "normal"
    """``normal`` or ``uniform`` (zero mean around delay_ms), or ``pareto`` (a heavy-tailed
    extra delay >= 0 with scale jitter_ms and shape ``jitter_pareto_shape``)."""

    jitter_pareto_shape: float = 3.0
    """Shape of the pareto jitter; must be > 2 so its variance is finite."""

    bandwidth_mbit: float | None = None
    """Rate cap in Mbit/s; ``None`` means uncapped (the emulator's own speed)."""

    queue_ms: float = 25.0
    """Bottleneck queue, in milliseconds of the link's rate. Bytes beyond it are not
    accepted from the sender (back-pressure), so memory stays bounded."""

    loss: float = 0.0
    """Fraction of TCP segments lost. TCP repairs a loss by retransmission, so no byte is
    lost: the stream stalls until the repair arrives (one round trip by fast retransmit,
    a retransmission timeout when too little is in flight) and the connection's
    congestion window is cut as CUBIC cuts it (:mod:`isthmus.sim.congestion`), so
    bulk throughput follows real TCP."""

    loss_burst_segments: float = 1.0
    """Mean number of consecutive segments lost in one burst. 1 gives independent
    (Bernoulli) losses; above 1 a Gilbert-Elliott chain with mean loss ``loss``."""

    corrupt: float = 0.0
    """Fraction of bytes that arrive with one bit flipped (a fault for checksum tests;
    real TCP would catch most of these, a middlebox bug would not)."""

    min_rto_ms: float = LINUX_MIN_RTO_MS
    """Lower bound of the retransmission timeout (a loss with fewer than four segments
    in flight cannot be fast-retransmitted and waits this long at least)."""

    mss_bytes: int = DEFAULT_MSS_BYTES
    """Segment size used to count segments for loss and for counters."""

    window_bytes: int = DEFAULT_WINDOW_BYTES
    """Most bytes one connection may have in flight in this direction (its TCP window).
    A window is acknowledged one round trip after it left, so throughput is at most
    window / RTT, as on a real long-fat path."""

    def __post_init__(self) -> None:
        _check_non_negative("delay_ms", self.delay_ms)
        _check_non_negative("jitter_ms", self.jitter_ms)
        if self.jitter_distribution not in JITTER_DISTRIBUTIONS:
            raise LinkConfigError(
                "jitter_distribution",
                f"unknown distribution {self.jitter_distribution!r}; "
                f"use one of {', '.join(JITTER_DISTRIBUTIONS)}",
            )
        if not (is_number(self.jitter_pareto_shape) and self.jitter_pareto_shape > 2):
            raise LinkConfigError(
                "jitter_pareto_shape",
                f"must be a number > 2 (finite variance), got {self.jitter_pareto_shape!r}",
            )
        if self.bandwidth_mbit is not None and not (
            is_number(self.bandwidth_mbit) and self.bandwidth_mbit > 0
        ):
            raise LinkConfigError(
                "bandwidth_mbit",
                f"must be a positive number of Mbit/s, got {self.bandwidth_mbit!r}; "
                "omit it for an uncapped link",
            )
        _check_non_negative("queue_ms", self.queue_ms)
        _check_fraction("loss", self.loss)
        if self.loss == 1.0:
            raise LinkConfigError(
                "loss", "1.0 would never deliver a byte; use a partition fault to cut a link"
            )
        if not (is_number(self.loss_burst_segments) and self.loss_burst_segments >= 1):
            raise LinkConfigError(
                "loss_burst_segments",
                f"must be >= 1 (1 = independent losses), got {self.loss_burst_segments!r}",
            )
        _check_fraction("corrupt", self.corrupt)
        _check_non_negative("min_rto_ms", self.min_rto_ms)
        if not (isinstance(self.mss_bytes, int) and 64 <= self.mss_bytes <= 65536):
            raise LinkConfigError(
                "mss_bytes", f"must be an integer in [64, 65536], got {self.mss_bytes!r}"
            )
        if not (isinstance(self.window_bytes, int) and self.window_bytes >= 65536):
            raise LinkConfigError(
                "window_bytes", f"must be an integer >= 65536, got {self.window_bytes!r}"
            )

    @property
    def rate_bytes_per_s(self) -> float | None:
        """The cap in bytes per second, or ``None`` when uncapped."""
        return None if self.bandwidth_mbit is None else self.bandwidth_mbit * 1e6 / 8

    def replace(self, **changes: Any) -> DirectionParams:
        """A copy with ``changes`` applied and validated; unknown names are refused."""
        unknown = sorted(set(changes) - DIRECTION_FIELDS)
        if unknown:
            raise LinkConfigError(unknown[0], _unknown_field_message(unknown[0]))
        return dataclasses.replace(self, **changes)


DIRECTION_FIELDS = frozenset(f.name for f in dataclasses.fields(DirectionParams))
# Names a user may give for a whole link; rtt_ms is split into a delay each way.
LINK_FIELDS = frozenset((DIRECTION_FIELDS - {"delay_ms"}) | {"rtt_ms"})


@dataclass(frozen=True)
class LinkParams:
    """Both directions of a link between sites ``a`` and ``b`` (in the order given)."""

    a_to_b: DirectionParams = field(default_factory=DirectionParams)
    b_to_a: DirectionParams = field(default_factory=DirectionParams)

    @classmethod
    def symmetric(cls, *, rtt_ms: float = 0.0, **direction: Any) -> LinkParams:
        """A link with the same behaviour both ways; each direction gets rtt_ms / 2."""
        _check_non_negative("rtt_ms", rtt_ms)
        params = direction_params(delay_ms=rtt_ms / 2, **direction)
        return cls(params, params)

    @property
    def rtt_ms(self) -> float:
        return self.a_to_b.delay_ms + self.b_to_a.delay_ms


def direction_params(**values: Any) -> DirectionParams:
    """Build :class:`DirectionParams`, refusing unknown names with a suggestion."""
    for name in values:
        if name not in DIRECTION_FIELDS:
            raise LinkConfigError(name, _unknown_field_message(name))
    return DirectionParams(**values)


def link_changes_to_direction(changes: dict[str, Any]) -> dict[str, Any]:
    """Turn link-level names (``rtt_ms``) into per-direction ones (``delay_ms``)."""
    out = dict(changes)
    if "rtt_ms" in out:
        rtt = out.pop("rtt_ms")
        _check_non_negative("rtt_ms", rtt)
        out["delay_ms"] = rtt / 2
    return out


def _unknown_field_message(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, sorted(LINK_FIELDS | DIRECTION_FIELDS), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown link setting; {hint}known: {', '.join(sorted(LINK_FIELDS))}"


def _check_non_negative(name: str, value: Any) -> None:
    if not (is_number(value) and value >= 0):
        raise LinkConfigError(name, f"must be a number >= 0, got {value!r}")


def _check_fraction(name: str, value: Any) -> None:
    if not (is_number(value) and 0 <= value <= 1):
        raise LinkConfigError(name, f"must be a fraction in [0, 1] (0.01 means 1%), got {value!r}")


def describe_link(p: Any, rtt_ms: float) -> str:
    """One line for a link direction's settings, as the emulator prints them."""
    bw = f"{p.bandwidth_mbit:g} Mbit/s" if p.bandwidth_mbit else "uncapped"
    parts = [f"rtt {rtt_ms:g} ms", bw]
    if p.jitter_ms:
        parts.append(f"jitter {p.jitter_ms:g} ms ({p.jitter_distribution})")
    if p.loss:
        burst = f", bursts of {p.loss_burst_segments:g}" if p.loss_burst_segments > 1 else ""
        parts.append(f"loss {p.loss:g}{burst}")
    if p.corrupt:
        parts.append(f"corrupt {p.corrupt:g}")
    return ", ".join(parts)

"""Linux TCP settings that hold back a long, fat WAN link, checked before a site starts.

The cross-site traffic is bursty: a round's exchange, then minutes of compute
while the connections sit idle. Two kernel defaults can cost every round on
such a link:

* ``net.ipv4.tcp_slow_start_after_idle = 1`` (the default) restarts a
  connection's congestion window from 10 segments after it was idle for one
  retransmission timeout (RFC 2861): with CUBIC, Linux's default congestion
  control, every exchange after compute starts in slow start again, several
  round trips below the link's rate. (BBR keeps its bandwidth estimate across
  idle: on this machine, whose default is BBR, ``isthmus bench allreduce
  --hosts --idle-s 2`` measured no difference either way.)
* ``net.ipv4.tcp_rmem`` / ``tcp_wmem`` maxima below a bandwidth-delay product
  cap a connection's window, whatever the link: 1 Gbit/s x 100 ms needs
  12.5 MB in flight; many distributions allow 4-6 MB.

These are the host's settings, not Isthmus's to change: the site prints what
it found and the ``sysctl`` line that fixes it, and starts anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

PROC_SYS = Path("/proc/sys")
WINDOW_BYTES = 32 * 2**20
"""TCP buffer maxima to ask for: 1 Gbit/s x 250 ms, a long link at full rate."""


def read_sysctl(name: str, root: Path = PROC_SYS) -> str | None:
    """The value of ``name`` (e.g. ``net.ipv4.tcp_rmem``), or None where unreadable."""
    try:
        return (root / name.replace(".", "/")).read_text().strip()
    except OSError:
        return None


def tcp_advice(read: Callable[[str], str | None] = read_sysctl) -> list[str]:
    """One line per setting of this host that slows a long, fat link, each with its fix."""
    advice = []
    if read("net.ipv4.tcp_slow_start_after_idle") == "1":
        advice.append(
            "net.ipv4.tcp_slow_start_after_idle is 1: after each compute phase TCP restarts "
            "the WAN connections from slow start, several round trips below the link's "
            "rate; fix: sysctl -w net.ipv4.tcp_slow_start_after_idle=0"
        )
    for name in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
        value = read(name)
        fields = value.split() if value else []
        if len(fields) == 3 and fields[2].isdigit() and int(fields[2]) < WINDOW_BYTES:
            low, default, high = fields
            advice.append(
                f"{name} allows windows of at most {int(high) / 2**20:.1f} MiB: a link of "
                f"1 Gbit/s and 100 ms needs 12.5 MB in flight; fix: sysctl -w "
                f"{name}='{low} {default} {WINDOW_BYTES}'"
            )
    return advice

"""Sites added to a running job: how a site describes itself, and how the others take it in.

An operator adds a site by appending it to the job file, making its certificate
with the job's CA (``isthmus certs`` again) and starting it with ``isthmus site
... --rejoin``. The sites already training still run the older job file, so the
new site tells them what they need in its control-plane status (``spec``): its
ranks, its layout and the address each rank is dialled at. The view that admits
it carries the same description, so a site that has not seen the status yet
learns it from the view.

Each rank of a running site then checks that the newcomer fits the job (the same
tensor and pipeline degrees; a data-parallel size that divides the job's lanes,
so no running site has to deal its traffic out again), accepts its handshakes
and sends to the rank that owns each of its lanes there. The membership admits
it like any joiner: at a round boundary, after it pulled the global state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from isthmus.job.layout import DIMENSIONS, Layout, LayoutError

MAX_RANKS = 65536
"""More ranks than any site has: a bound on what a peer's message may ask us to hold."""


@dataclass(frozen=True)
class NewSite:
    """A site that is not in this site's job file, as it describes itself."""

    name: str
    layout: Layout
    dial: tuple[tuple[str, int], ...]
    """Index = the site's rank."""

    def to_message(self) -> dict[str, Any]:
        return {
            "ranks": self.layout.size,
            "parallel": {d: getattr(self.layout, d) for d in DIMENSIONS},
            "dial": [f"{host}:{port}" for host, port in self.dial],
        }

    def lane_addresses(
        self, lanes: int, my_lanes: range, coordinates: Mapping[str, int]
    ) -> dict[int, str] | str:
        """For each lane this rank owns, the address of the rank that owns it in the
        new site; or why this site cannot take it in."""
        mine = f"tp {coordinates['tp']}, pp {coordinates['pp']}"
        if coordinates["tp"] >= self.layout.tp or coordinates["pp"] >= self.layout.pp:
            return f"site {self.name!r} has no rank at {mine} (its layout: {self.layout})"
        dp = self.layout.dp
        if lanes % dp:
            return (
                f"site {self.name!r} has {dp} data-parallel ranks, which do not divide the "
                f"job's {lanes} lanes; give it a data-parallel size that divides {lanes}"
            )
        per_rank = lanes // dp
        return {
            lane: "{}:{}".format(
                *self.dial[
                    self.layout.rank_of(
                        pp=coordinates["pp"], dp=lane // per_rank, tp=coordinates["tp"]
                    )
                ]
            )
            for lane in my_lanes
        }


def describe(layout: Layout, dial: list[tuple[str, int]] | None) -> dict[str, Any] | None:
    """A site's ``spec`` for its status: None where it has no address to be dialled at
    (an emulated run, where sites cannot be added)."""
    if not dial:
        return None
    return NewSite("", layout, tuple(dial)).to_message()


def parse(name: str, message: Any, *, tp: int, pp: int) -> NewSite | str:
    """The newcomer ``name`` describes, or why it cannot be one of this job's sites
    (``tp``, ``pp``: the job's degrees, which every site shares)."""
    if not isinstance(message, Mapping):
        return f"site {name!r} is not in the job file and describes no layout ('spec')"
    ranks = message.get("ranks")
    if not (isinstance(ranks, int) and not isinstance(ranks, bool) and 1 <= ranks <= MAX_RANKS):
        return f"'spec.ranks' must be an integer in [1, {MAX_RANKS}], got {ranks!r}"
    parallel = message.get("parallel")
    if not isinstance(parallel, Mapping):
        return f"'spec.parallel' must be an object of degrees, got {parallel!r}"
    try:
        layout = Layout.for_ranks(ranks, dict(parallel))
    except LayoutError as exc:
        return f"'spec.{exc}'"
    if (layout.tp, layout.pp) != (tp, pp):
        return (
            f"site {name!r} has tp {layout.tp} and pp {layout.pp}; every site of this job "
            f"has tp {tp} and pp {pp}"
        )
    dial = message.get("dial")
    if not (isinstance(dial, list) and len(dial) == ranks):
        return f"'spec.dial' must list one host:port per rank ({ranks}), got {dial!r}"
    addresses = []
    for entry in dial:
        host, _, port = str(entry).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return f"'spec.dial' entries must be host:port, got {entry!r}"
        addresses.append((host.strip("[]"), int(port)))
    return NewSite(name, layout, tuple(addresses))

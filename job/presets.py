"""Named link presets with realistic round-trip times between cloud regions.

RTTs are rounded medians of the inter-region round trips that cloud providers
publish (Azure: "Azure network round-trip latency statistics", learn.microsoft.com,
monthly medians between region pairs; AWS and GCP dashboards agree within a few
ms). Jitter is the spread those pages show on private backbones (small). The
bandwidths are a *choice*, not a measurement: a plausible share of a leased
inter-region line for one training job; set ``bandwidth_mbit`` for your contract.
See docs/wan-emulator.md for the table and caveats.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Two availability zones of one region: providers quote < 2 ms round trip.
    "same-region": {"rtt_ms": 1.5, "jitter_ms": 0.1, "bandwidth_mbit": 10_000},
    # US East (Virginia) <-> US West (Washington/Oregon): ~65-70 ms.
    "cross-country": {"rtt_ms": 68.0, "jitter_ms": 0.5, "bandwidth_mbit": 1_000},
    # US East (Virginia) <-> Western Europe (Netherlands/Ireland): ~80 ms.
    "transatlantic": {"rtt_ms": 80.0, "jitter_ms": 0.5, "bandwidth_mbit": 1_000},
    # US West <-> Japan East (Tokyo): ~100-110 ms.
    "transpacific": {"rtt_ms": 105.0, "jitter_ms": 1.0, "bandwidth_mbit": 500},
    # Western Europe <-> Southeast Asia (Singapore): ~150-160 ms.
    "europe-asia": {"rtt_ms": 155.0, "jitter_ms": 1.5, "bandwidth_mbit": 500},
}


def preset(name: str) -> dict[str, Any]:
    """The link settings of a named preset (a copy); unknown names list the known ones."""
    try:
        return dict(PRESETS[name])
    except KeyError:
        raise KeyError(
            f"unknown link preset {name!r}; known presets: {', '.join(PRESETS)}"
        ) from None

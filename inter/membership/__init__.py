"""Who takes part in the rounds: the pure protocol (:mod:`.protocol`: views,
reports, the leader's decision) and one site's runtime around it
(:mod:`.runtime`)."""

from isthmus.inter.membership.protocol import (
    ENGINE_MARGIN,
    PHASES,
    Report,
    View,
    consider,
    decide,
    first_view,
    leader_of,
    stuck_in,
)
from isthmus.inter.membership.runtime import (
    PROBE_EVERY_S,
    PROPOSAL_WAIT_S,
    LeftTheRun,
    Membership,
    MembershipError,
    RunOver,
)

__all__ = [
    "ENGINE_MARGIN",
    "PHASES",
    "PROBE_EVERY_S",
    "PROPOSAL_WAIT_S",
    "LeftTheRun",
    "Membership",
    "MembershipError",
    "Report",
    "RunOver",
    "View",
    "consider",
    "decide",
    "first_view",
    "leader_of",
    "stuck_in",
]

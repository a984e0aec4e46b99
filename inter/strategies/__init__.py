"""The sync strategies: how often and how sites agree on the model.

The user keeps their own training loop; a strategy hooks the optimizer:

* :class:`Sync` averages gradients across sites before every optimizer step
  (the hierarchical all-reduce), so every site takes the same step;
* :class:`DiLoCo` lets every site take ``sync_every`` inner steps, then seals
  the round (participants and weights), averages the pseudo-gradients
  (global minus local parameters) and applies the outer optimizer; the model
  is reset to the new global parameters, bitwise identical on every site;
* :class:`StreamingDiLoCo` does that in fragments at staggered steps, each
  exchange overlapping inner steps and merged with a mixing factor;
* :class:`AsyncDiLoCo` hides each exchange behind the next round's compute
  and applies it one round late.

Round numbers come from the site (one counter per site, advanced identically
everywhere), so strategies can be switched between rounds.

One module per strategy (``sync``, ``diloco``, ``streaming``, ``async_diloco``),
beside what they share: ``base`` (:class:`Strategy`: the hooks, the exchange, the
counters) and ``local_steps`` (the DiLoCo family's local steps and outer
optimizer). Each strategy holds its collaborators, built in its ``__init__``:
the membership rounds (:class:`~isthmus.inter.member_rounds.MemberRounds`) and,
for the DiLoCo family, the outer optimizer.
"""

from isthmus.inter.strategies.async_diloco import AsyncDiLoCo
from isthmus.inter.strategies.base import Blocked, Strategy
from isthmus.inter.strategies.diloco import DiLoCo
from isthmus.inter.strategies.local_steps import LocalSteps
from isthmus.inter.strategies.streaming import StreamingDiLoCo
from isthmus.inter.strategies.sync import Sync

__all__ = [
    "AsyncDiLoCo",
    "Blocked",
    "DiLoCo",
    "LocalSteps",
    "Strategy",
    "StreamingDiLoCo",
    "Sync",
]

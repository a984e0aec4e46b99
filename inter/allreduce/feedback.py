"""Error feedback: what a lossy codec lost of this site's contribution goes into the next one.

A lossy codec (int8, int4, ...) loses a little of every value it encodes. Sent
round after round, the same vector (the model's pseudo-gradient, a
fragment's) would lose it again and again, always in the same direction; with
error feedback the loss of round r is added to the contribution of round
r + 1 under the same key, so it is sent late instead of never. Keys are the
caller's names of its vectors (``"model"``, a fragment's name).

The direct and gather algorithms (and two_level, through direct) use it: there a
site's contribution is encoded once, by itself, so its loss is its own. The ring
re-encodes partial sums at
every hop, where one site's loss is not separable from the others'. With the
exact codec (``none``) there is nothing to feed back.

The residuals are part of a checkpoint taken between rounds: with a lossy
codec, resuming without them would not be bit-for-bit. A residual lives on the
device of the values it corrects (loaded from a CPU checkpoint, it moves there
at its next round); :meth:`ErrorFeedback.state` gives them where they are.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from isthmus.inter.codecs import Codec


class ErrorFeedback:
    """One engine's residuals, per vector."""

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def state(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """The residuals, per vector. ``copy=False``: the residual tensors themselves,
        a snapshot all the same, since a round replaces a vector's residual and
        never changes it in place."""
        return {name: r.clone() if copy else r for name, r in self._residuals.items()}

    def load_state(self, residuals: Mapping[str, torch.Tensor]) -> None:
        self._residuals = {name: r.clone() for name, r in residuals.items()}

    def begin(
        self, key: str | None, flat: torch.Tensor, codec: Codec, *, counted: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This round's contribution (``flat`` plus what the codec lost last time) and
        a zeroed tensor for what it loses this time, or ``flat`` and None where there
        is no feedback: no key, an exact codec, or a site not ``counted`` (weight 0:
        it sent nothing that counts, so its residual waits for the next round it
        counts in)."""
        if key is None or codec.name == "none" or not counted:
            return flat, None
        residual = self._residuals.get(key)
        if residual is not None and residual.numel() == flat.numel():
            # topk's feedback_decay (below 1: the residual stands in for momentum).
            decay = codec.sparse.feedback_decay if codec.sparse is not None else 1.0
            residual = residual.to(flat.device)
            flat = flat + (residual if decay == 1 else residual * decay)
        return flat, torch.zeros_like(flat)

    def keep(self, key: str, lost: torch.Tensor) -> None:
        """What the codec lost of a round that completed, for the next under ``key``."""
        self._residuals[key] = lost

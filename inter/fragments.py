"""Streaming DiLoCo's fragments: which parameters sync together, and when.

Parameters are split into ``P`` fragments strided over the model's blocks:
block ``i`` (a parameter name with a numeric part, ``layers.7.mlp.w1.weight``)
goes to fragment ``i mod P``, so every fragment spans the depth of the model
(Douillard et al., 2025: strided fragments train better than consecutive
ones). Parameters outside the blocks join the fragment of the block before
them (the embeddings, before any block, join fragment 0).

Within each outer period of ``H`` inner steps, fragment ``p`` starts its
exchange after step ``(p + 1) H / P`` (rounded down), so exchanges are
staggered and at most one is on the wire when the overlap is below ``H / P``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_BLOCK = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def block_index(name: str) -> int | None:
    """The first numeric component of a parameter name, or None."""
    match = _BLOCK.search(name)
    return int(match.group(1)) if match else None


def count_blocks(names: Sequence[str]) -> int:
    return len({i for n in names if (i := block_index(n)) is not None})


def assign_fragments(names: Sequence[str], fragments: int) -> list[int]:
    """The fragment of every parameter, in order."""
    out: list[int] = []
    current = 0
    order: dict[int, int] = {}
    for name in names:
        index = block_index(name)
        if index is not None:
            # Blocks numbered in the order they appear (names may skip numbers,
            # as a pipeline stage's do).
            position = order.setdefault(index, len(order))
            current = position % fragments
        out.append(current)
    return out

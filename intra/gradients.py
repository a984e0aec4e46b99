"""Gradient clipping by the norm of the whole model's gradient, wherever its pieces live.

A site's model may be cut into pipeline stages (each rank holds some layers),
split by tensor parallelism and sharded by FSDP (DTensors). The norm that
clipping compares with its limit is the whole model's: every tensor's norm is
taken in full (a DTensor's over its mesh), and the squares of the stages'
norms are summed over the pipeline group.

Sites that hold bitwise-identical gradients (``sync``, after its exchange)
must clip them identically, though one may hold a tensor whole and another in
FSDP shards, which sum the same squares in another order. The sums run in
float64 and the scale is applied in float32: orders differ by about 1e-16 of
the norm, so the float32 scales agree unless the norm falls within that of a
float32 rounding boundary (about one step in 10^9).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def total_grad_norm(
    params: Iterable[torch.Tensor], stage_group: dist.ProcessGroup | None = None
) -> float:
    """The L2 norm of the gradients of ``params`` (those that have one), over every
    shard and, with ``stage_group`` (the ranks holding the other pipeline stages),
    every stage."""
    squares = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        norm = torch.linalg.vector_norm(p.grad, dtype=torch.float64)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares += norm**2
    if stage_group is not None:
        dist.all_reduce(squares, group=stage_group)
    return float(squares.sqrt())


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[torch.Tensor],
    max_norm: float,
    stage_group: dist.ProcessGroup | None = None,
) -> float:
    """Scale the gradients of ``params`` so that their norm (:func:`total_grad_norm`)
    is at most ``max_norm``; returns the norm before. A norm that is not finite
    leaves them as they are (the strategies refuse such contributions with the
    site's name, which a silent NaN scale would hide)."""
    params = list(params)
    norm = total_grad_norm(params, stage_group)
    scale = max_norm / (norm + 1e-6)
    if math.isfinite(norm) and scale < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm

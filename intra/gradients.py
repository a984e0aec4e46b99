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

:func:`average_replica_gradients` averages the gradients of a site's
data-parallel replicas (where FSDP does not do it itself) in buckets, as DDP
does: one all-reduce per ~25 MiB instead of one per parameter, which on NCCL
or Gloo is latency-bound for the many small tensors of a transformer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from isthmus.intra import collectives
from isthmus.intra.collectives import device_of

BUCKET_BYTES = 25 * 2**20
"""DDP's default bucket: large enough that each all-reduce runs near the fabric's
bandwidth, small enough that the flat copy costs little memory."""


def total_grad_norm(
    params: Iterable[torch.Tensor],
    stage_group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | None = None,
) -> float:
    """The L2 norm of the gradients of ``params`` (those that have one), over every
    shard and, with ``stage_group`` (the ranks holding the other pipeline stages),
    every stage. ``device``: the rank's compute device (default: the gradients')."""
    grads = [p.grad for p in params if p.grad is not None]
    return float(_squared_norm(grads, stage_group, device).sqrt())


def _squared_norm(
    grads: list[torch.Tensor], stage_group: dist.ProcessGroup | None, device: torch.device | None
) -> torch.Tensor:
    """The sum of the squares of the gradients' norms, float64, 0-dim, where the
    gradients are; nothing read on the host."""
    if not grads:  # a stage without gradients still joins the collective
        squares = torch.zeros((), dtype=torch.float64, device=device or "cpu")
    elif any(isinstance(g, DTensor) for g in grads):
        squares = None
        for grad in grads:
            norm = torch.linalg.vector_norm(grad, dtype=torch.float64)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            # Summed where the gradients are: a CPU accumulator would mix devices.
            squares = norm**2 if squares is None else squares + norm**2
        assert squares is not None
    else:
        # One multi-tensor kernel for the norms instead of three launches per tensor
        # (the 125m model's 198 tensors took ~600 launches, several ms of host time
        # per step on a GPU). The squares are summed in order, as one tensor at a
        # time did: a CPU cumsum adds sequentially, so the sum is bitwise the same.
        norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
        squares = torch.stack(norms).square().cumsum(0)[-1]
    if stage_group is not None:
        collectives.all_reduce(
            squares,
            group=stage_group,
            device=device or device_of(squares),
            where="gradients.total_grad_norm",
        )
    return squares


@torch.no_grad()
def average_replica_gradients(
    parameters: Iterable[torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    bucket_bytes: int = BUCKET_BYTES,
    device: torch.device | None = None,
) -> int:
    """Replace each gradient of ``parameters`` by its mean over ``group`` (the site's
    data-parallel replicas), in buckets of about ``bucket_bytes``; returns the
    number of all-reduces. A DTensor gradient (tensor parallel) is averaged in its
    local piece: replicas hold the same pieces. ``device``: the rank's compute
    device (default: the gradients').

    Every rank must hold gradients for the same parameters in the same order (as
    replicas do), so that the buckets line up. A bucket is flattened, reduced once
    and copied back; a tensor alone in its bucket is reduced in place (no copy of
    a large embedding). The sum per element is the one the per-parameter reduction
    makes with 2 replicas (a + b = b + a in IEEE arithmetic), so the result is
    bitwise the same; with 3 or more, the backend's summation order may depend on
    where an element falls in the buffer, so it agrees within float rounding."""
    grads = []
    for p in parameters:
        if p.grad is not None:
            grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    size = dist.get_world_size(group)
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    current_bytes = 0
    key = None
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        # One dtype and device per bucket (the flat buffer has one of each).
        if current and (current_bytes + nbytes > bucket_bytes or (grad.dtype, grad.device) != key):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(grad)
        current_bytes += nbytes
        key = (grad.dtype, grad.device)
    if current:
        buckets.append(current)
    for bucket in buckets:
        on = device or device_of(bucket[0])
        if len(bucket) == 1 and bucket[0].is_contiguous():
            collectives.all_reduce(
                bucket[0], group=group, device=on, where="gradients.average_replica_gradients"
            )
            bucket[0].div_(size)
            continue
        flat = _flatten_dense_tensors(bucket)
        collectives.all_reduce(
            flat, group=group, device=on, where="gradients.average_replica_gradients"
        )
        flat.div_(size)
        for grad, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            grad.copy_(averaged)
    return len(buckets)


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[torch.Tensor],
    max_norm: float,
    stage_group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | None = None,
) -> float:
    """Scale the gradients of ``params`` so that their norm (:func:`total_grad_norm`)
    is at most ``max_norm``; returns the norm before. A norm that is not finite
    leaves them as they are (the strategies refuse such contributions with the
    site's name, which a silent NaN scale would hide)."""
    return float(clip_gradients(params, max_norm, stage_group, device=device))


@torch.no_grad()
def clip_gradients(
    params: Iterable[torch.Tensor],
    max_norm: float,
    stage_group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | None = None,
) -> torch.Tensor:
    """:func:`clip_grad_norm` without waiting for the device: the norm before comes
    back as a 0-dim float64 tensor where the gradients are, unread.

    On a GPU, reading the norm on the host (to decide whether to scale) stalls
    the host until the backward pass has finished, and the device then idles
    while the host launches the optimizer's step. The decision is made on the
    device instead: the gradients are multiplied by ``min(1, max_norm / (norm +
    1e-6))``, or by 1 when the norm is not finite, as torch's own
    ``clip_grad_norm_`` does. Multiplying by 1 leaves every value as it is, and
    the scale is rounded to the gradients' float32 as a Python float was, so the
    results are bitwise those of scaling only when needed. DTensor gradients
    (FSDP, tensor parallel) keep the host path as it was: whether DTensor's
    multi-tensor ops take a plain tensor as the scale was not checked."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    norm = _squared_norm(grads, stage_group, device).sqrt()
    if any(isinstance(g, DTensor) for g in grads):
        value = float(norm)
        scale = max_norm / (value + 1e-6)
        if math.isfinite(value) and scale < 1.0:
            for grad in grads:
                grad.mul_(scale)
        return norm
    if not grads:
        return norm
    # A tensor's max_norm / x, not Python's max_norm / tensor (which torch computes
    # as a reciprocal times max_norm: another rounding).
    factor = norm.new_full((), max_norm) / (norm + 1e-6)
    factor = torch.where(torch.isfinite(norm), factor.clamp(max=1.0), 1.0)
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for grad in grads:
        by_kind.setdefault((grad.dtype, grad.device), []).append(grad)
    for (dtype, on), group in by_kind.items():
        # What a Python float scale became in a multiply: float32 (or float64).
        scalar = factor.to(device=on, dtype=torch.promote_types(dtype, torch.float32))
        torch._foreach_mul_(group, scalar)
    return norm

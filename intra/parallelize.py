"""Applying a site's layout to a model with PyTorch's own parallelisms.

Built so far: data-parallel sharding with FSDP2 (``fully_shard``) over the
``dp_shard`` dimension, and HSDP (replicas of shard groups) when
``dp_replicate`` is also above one. Every transformer block is its own FSDP
unit (its parameters are gathered just before it runs and freed after), and
the root holds the embeddings and the head.

A user's own model takes the same path when its blocks are listed by
``blocks``; see docs/ARCHITECTURE.md for the composition order the tensor and
pipeline parallelisms will join (tensor parallel first, then FSDP over the
data-parallel dimensions, pipeline stages outermost).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from isthmus.intra.layout import DIMENSIONS, Layout


def site_mesh(layout: Layout, device_type: str | None = None) -> DeviceMesh:
    """The site's DeviceMesh, dimensions named as in :mod:`isthmus.intra.layout`."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(device_type, layout.shape, mesh_dim_names=DIMENSIONS)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, blocks: Iterable[nn.Module]) -> nn.Module:
    """Shard ``model`` over the mesh's data-parallel dimensions (FSDP2, or HSDP
    when both ``dp_replicate`` and ``dp_shard`` are above one)."""
    dp_mesh = mesh["dp_replicate", "dp_shard"]
    if dp_mesh.size() == 1:
        return model
    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def needs_fsdp(layout: Layout) -> bool:
    return layout.dp_shard > 1

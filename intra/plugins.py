"""A user's own model and data, named by import path (``package.module:function``).

The model function takes no arguments and returns an ``nn.Module``. It may
set two attributes on it: ``isthmus_plan`` (a
:class:`~isthmus.intra.parallelize.ModelPlan`: its blocks, a tensor-parallel
plan, a pipeline stage function) and ``isthmus_loss`` (``(outputs, targets)
-> scalar``; default: next-token cross-entropy). Without a plan the model can
be replicated or sharded as a whole (FSDP2), not split by tensor or pipeline.

The data function takes a :class:`DataContext` and returns an iterator of
``(inputs, targets)`` batches for that data-parallel rank: it must be
deterministic in the context, and different ranks must get different data.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DataContext:
    """What a data function needs to produce one rank's batches."""

    site: str
    site_index: int
    site_count: int
    dp_rank: int
    """The data-parallel rank within the site."""
    dp_size: int
    ranks_per_site: tuple[int, ...]
    """Data-parallel ranks of every site, in the job's order."""
    batch_size: int
    seed: int
    split: str = "train"
    """``train``, or ``eval`` for the held-out batches that measure the model (the same
    ones every time the function is called with it)."""

    @classmethod
    def for_rank(
        cls,
        sites: Sequence[str],
        dp_sizes: Sequence[int],
        site_index: int,
        dp_rank: int,
        *,
        batch_size: int,
        seed: int,
        split: str = "train",
    ) -> DataContext:
        """The context of data-parallel rank ``dp_rank`` of site ``site_index``, given
        every site's name and data-parallel size in the job's order."""
        return cls(
            site=sites[site_index],
            site_index=site_index,
            site_count=len(sites),
            dp_rank=dp_rank,
            dp_size=dp_sizes[site_index],
            ranks_per_site=tuple(dp_sizes),
            batch_size=batch_size,
            seed=seed,
            split=split,
        )


DataFunction = Callable[[DataContext], Iterator[tuple[torch.Tensor, torch.Tensor]]]


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """``package.module:function`` -> the function; errors say which part is wrong."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{what}: {spec!r} is not 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"{what}: cannot import {module_name!r} ({exc}); is it installed or on PYTHONPATH?"
        ) from None
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{what}: module {module_name!r} has no {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{what}: {spec!r} is not callable")
    return target


def load_model(spec: str) -> torch.nn.Module:
    model = load_callable(spec, "model")()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model: {spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model

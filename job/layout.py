"""A site's parallel layout: how its ranks split the model and the data.

Four named dimensions, outermost first, as the site's DeviceMesh orders them:

* ``pp``: pipeline stages (layers split into consecutive groups);
* ``dp_replicate``: data-parallel replicas (each holds the whole model, or the
  whole of its shard group's model);
* ``dp_shard``: data-parallel ranks that shard parameters, gradients and
  optimizer state (FSDP2);
* ``tp``: tensor-parallel ranks (attention heads and MLP columns split).

``tp`` is innermost so tensor-parallel peers are neighbouring ranks (one node,
the fastest links); ``pp`` outermost so stages can span nodes. The product
must equal the site's rank count. Sites may differ in ``dp_*``; ``tp`` and
``pp`` must match across sites, because the cross-site layer pairs ranks that
hold the same parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol


class ModelShape(Protocol):
    """What a layout checks of a model (:class:`isthmus.intra.model.GPTConfig` has it):
    the job model reads layouts and must not import torch."""

    n_head: int
    d_ff: int
    n_layer: int


DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "tp")


class LayoutError(ValueError):
    """A layout that cannot work; the message shows the numbers and the fix."""


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @classmethod
    def for_ranks(
        cls, ranks: int, given: dict[str, Any] | None = None, *, where: str = ""
    ) -> Layout:
        """The layout of a site of ``ranks`` ranks from the job file's ``parallel:``
        mapping. Omitted dimensions are 1, except ``dp_replicate``, which takes what
        is left (so ``parallel: {dp_shard: 2}`` on 4 ranks is 2 replicas of 2 shards)."""
        prefix = f"{where}." if where else ""
        given = dict(given or {})
        unknown = sorted(set(given) - set(DIMENSIONS))
        if unknown:
            raise LayoutError(
                f"{prefix}parallel: unknown dimension(s) {unknown}; use {', '.join(DIMENSIONS)}"
            )
        for name, value in given.items():
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise LayoutError(
                    f"{prefix}parallel.{name}: must be an integer >= 1, got {value!r}"
                )
        if "dp_replicate" not in given:
            others = math.prod(given.get(d, 1) for d in DIMENSIONS if d != "dp_replicate")
            if ranks % others:
                raise LayoutError(
                    f"{prefix}parallel: pp x dp_shard x tp = {others} does not divide the "
                    f"site's {ranks} ranks; change the degrees or the site's ranks"
                )
            given["dp_replicate"] = ranks // others
        layout = cls(**given)
        if layout.size != ranks:
            raise LayoutError(
                f"{prefix}parallel: {layout.describe()} is {layout.size} ranks, but the site has "
                f"{ranks}; the product of the degrees must equal the site's ranks"
            )
        return layout

    @property
    def size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in DIMENSIONS)

    def describe(self) -> str:
        return " x ".join(f"{d}={getattr(self, d)}" for d in DIMENSIONS)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along every dimension (row-major over DIMENSIONS)."""
        coords = {}
        for name, size in reversed(list(zip(DIMENSIONS, self.shape, strict=True))):
            coords[name] = rank % size
            rank //= size
        return {d: coords[d] for d in DIMENSIONS}

    def dp_rank(self, rank: int) -> int:
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def rank_of(self, *, pp: int, dp: int, tp: int) -> int:
        """The rank at pipeline stage ``pp``, data-parallel rank ``dp``, tensor rank ``tp``."""
        dp_replicate, dp_shard = divmod(dp, self.dp_shard)
        return ((pp * self.dp_replicate + dp_replicate) * self.dp_shard + dp_shard) * self.tp + tp

    def dp_peers(self, rank: int) -> list[int]:
        """The ranks sharing ``rank``'s pipeline stage and tensor rank, by dp rank."""
        c = self.coordinates(rank)
        return [self.rank_of(pp=c["pp"], dp=d, tp=c["tp"]) for d in range(self.dp)]

    def check_model(self, config: ModelShape, *, where: str = "") -> None:
        """Refuse degrees the model's dimensions cannot be split by."""
        prefix = f"{where}." if where else ""
        if config.n_head % self.tp:
            raise LayoutError(
                f"{prefix}parallel.tp = {self.tp} does not divide model.n_head = {config.n_head}; "
                f"tensor parallelism splits attention heads: use tp in "
                f"{[k for k in range(1, config.n_head + 1) if config.n_head % k == 0]}"
            )
        if config.d_ff % self.tp:
            raise LayoutError(
                f"{prefix}parallel.tp = {self.tp} does not divide model.d_ff = {config.d_ff}"
            )
        if self.pp > config.n_layer:
            raise LayoutError(
                f"{prefix}parallel.pp = {self.pp} stages for model.n_layer = {config.n_layer} "
                f"layers: every stage needs at least one layer; use pp <= {config.n_layer}"
            )

    def matches_across_sites(self, other: Layout) -> bool:
        """Whether two sites can exchange state: same tensor and pipeline split."""
        return (self.tp, self.pp) == (other.tp, other.pp)


def check_sites(layouts: dict[str, Layout]) -> None:
    """Every site must share ``tp`` and ``pp``; the message names both layouts."""
    items = list(layouts.items())
    first_name, first = items[0]
    for name, layout in items[1:]:
        if not first.matches_across_sites(layout):
            raise LayoutError(
                f"sites {first_name!r} ({first.describe()}) and {name!r} ({layout.describe()}) "
                f"differ in tp or pp; sites may differ in dp_replicate and dp_shard only"
            )


def stage_layers(n_layer: int, pp: int, stage: int) -> range:
    """The layers of pipeline stage ``stage``: consecutive, sizes differing by <= 1."""
    base, extra = divmod(n_layer, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))

"""Before the first step: one model on every site, or a clear refusal.

A training script builds its model on every site by itself, so nothing makes
the sites start alike: another seed, another initialisation, another config.
:func:`agree_on_model` runs a few small rounds through the site's exchange
(the same cross-site all-reduce the strategies use, so no other channel is
needed) before any strategy takes over:

1. every site learns the first site's parameter count, a digest of its names
   and shapes, and a digest of its values (a weighted average in which only
   the first site counts is the first site's vector, bit for bit);
2. every site learns which sites differ from the first (a flag per site);
3. names or shapes differ: every site learns the first site's digest per
   parameter, so each differing site names its first differing parameter,
   and every site refuses to train, naming the sites;
4. only values differ: every site takes the first site's values the same
   way, so the global model starts from one agreed state.

Every site takes the same rounds in the same order (each decision rests on
values every site holds after the round before), and every rank of a site
takes part (a multi-rank site agrees on its flags over its own group first).
Numbers cross as float32 pieces of 16 bits, which it holds exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from isthmus.inter.codecs import parse_codec
from isthmus.inter.join import SiteRuntime
from isthmus.intra import collectives

PIECES = 4
"""16-bit pieces per digest: 64 bits, exact in float32."""


class ModelMismatch(RuntimeError):
    """The sites' models differ in parameter names or shapes."""


@dataclass(frozen=True)
class Agreement:
    """What :func:`agree_on_model` found."""

    differing_values: list[str]
    """Sites whose initial values differed from the first site's (now replaced)."""


def _pieces(data: bytes) -> list[float]:
    digest = hashlib.sha256(data).digest()
    return [float(int.from_bytes(digest[2 * i : 2 * i + 2], "little")) for i in range(PIECES)]


def _describe(name: str, shape: Sequence[int]) -> bytes:
    return f"{name}:{tuple(int(d) for d in shape)}".encode()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _site_digest(digest: bytes, site: SiteRuntime) -> list[float]:
    """The site's digest of its values from each rank's: replicas hold the same
    values (counted once, so 2 data-parallel replicas match 1 rank), shards and
    stages their own parts (all of them count, in rank order)."""
    if site.site.ranks == 1:
        return _pieces(digest)
    mine = torch.tensor(list(digest), dtype=torch.int64, device=site.device)
    every = [torch.zeros_like(mine) for _ in range(site.site.ranks)]
    collectives.all_gather(every, mine, device=site.device, where="agreement.site_digest")
    distinct: list[bytes] = []
    for rank_digest in every:
        one = bytes(rank_digest.tolist())
        if one not in distinct:
            distinct.append(one)
    return _pieces(b"".join(distinct))


def _site_max(values: torch.Tensor, site: SiteRuntime) -> torch.Tensor:
    if site.site.ranks > 1:
        collectives.all_reduce(
            values, op=dist.ReduceOp.MAX, device=site.device, where="agreement.site_flags"
        )
    return values


def _round(site: SiteRuntime, vector: torch.Tensor, weights: dict[str, float]) -> torch.Tensor:
    """``vector`` (the same on every rank of this site) averaged over every site."""
    out = vector.clone()
    site.step.start(
        [out],
        round=site.next_round(),
        participants=site.names,
        weights=weights,
        in_site_reduce=False,
    ).wait()
    return out


def agree_on_model(
    site: SiteRuntime, named: Sequence[tuple[str, torch.Tensor]], *, device: torch.device
) -> Agreement:
    """Check that every site trains the same parameters (names and shapes, in
    order), then give every site the first site's values. Raises
    :class:`ModelMismatch` on every site when they differ in names or shapes."""
    names = site.names
    first = names[0]
    only_first = {n: (1.0 if n == first else 0.0) for n in names}
    everyone = {n: 1.0 for n in names}
    engines = list(site.endpoint.engines.values())
    codecs = [e.codec for e in engines]
    site.set_codec(parse_codec("none"))  # agreement is exact, whatever the job sends later
    try:
        return _agree(site, named, device, first, only_first, everyone)
    finally:
        for engine, codec in zip(engines, codecs, strict=True):
            engine.codec = codec


def _agree(
    site: SiteRuntime,
    named: Sequence[tuple[str, torch.Tensor]],
    device: torch.device,
    first: str,
    only_first: dict[str, float],
    everyone: dict[str, float],
) -> Agreement:
    names = site.names
    shapes = b"\n".join(_describe(n, p.shape) for n, p in named)
    values = hashlib.sha256()
    for _, p in named:
        values.update(_local(p).detach().float().contiguous().cpu().numpy().tobytes())
    mine = torch.tensor(
        [float(len(named)), *_pieces(shapes), *_site_digest(values.digest(), site)],
        dtype=torch.float32,
        device=device,
    )
    theirs = _round(site, mine, only_first).cpu()
    first_count = int(theirs[0])
    shape_differs = not torch.equal(theirs[: 1 + PIECES], mine[: 1 + PIECES].cpu())
    value_differs = not torch.equal(theirs[1 + PIECES :], mine[1 + PIECES :].cpu())

    me = names.index(site.name)
    flags = torch.zeros(2 * len(names), dtype=torch.float32, device=site.device)
    flags[me] = float(shape_differs)
    flags[len(names) + me] = float(value_differs)
    flags = _site_max(flags, site)  # a site differs when any of its ranks does
    flags = _round(site, flags.to(device), everyone).cpu() * len(names)
    shape_sites = [n for i, n in enumerate(names) if flags[i] > 0.5]
    value_sites = [n for i, n in enumerate(names) if flags[len(names) + i] > 0.5]

    if shape_sites:
        per_parameter = torch.zeros(first_count * PIECES, dtype=torch.float32)
        for i, (name, p) in enumerate(named[:first_count]):
            per_parameter[i * PIECES : (i + 1) * PIECES] = torch.tensor(
                _pieces(_describe(name, p.shape))
            )
        reference = _round(site, per_parameter.to(device), only_first).cpu()
        raise ModelMismatch(_mismatch(site.name, first, named, first_count, reference, shape_sites))
    if value_sites:
        # Sharded parameters stay DTensors: the step sends each rank's shard to the
        # ranks of the other sites that hold those elements, whatever their layouts.
        tensors = [p.data for _, p in named]
        with torch.no_grad():
            site.step.start(
                tensors,
                round=site.next_round(),
                participants=names,
                weights=only_first,
                in_site_reduce=False,
            ).wait()
    return Agreement(differing_values=value_sites)


def _mismatch(
    me: str,
    first: str,
    named: Sequence[tuple[str, torch.Tensor]],
    first_count: int,
    reference: torch.Tensor,
    differing: list[str],
) -> str:
    fix = (
        "every site must build the same model (the same config and code), so that "
        "the parameters match by name and shape, in order"
    )
    others = ", ".join(differing)
    if me not in differing:
        return (
            f"the model's parameters differ between sites: sites that differ from site "
            f"{first!r} in names or shapes: {others} (their logs name the first parameter); "
            f"{fix}"
        )
    for i, (name, p) in enumerate(named[:first_count]):
        if not torch.equal(
            reference[i * PIECES : (i + 1) * PIECES],
            torch.tensor(_pieces(_describe(name, p.shape))),
        ):
            return (
                f"the model's parameters differ between sites: parameter {i} "
                f"{name!r} {tuple(p.shape)} on site {me!r} is not the one site {first!r} "
                f"has there (name or shape); sites that differ from {first!r}: {others}; {fix}"
            )
    return (
        f"the model's parameters differ between sites: site {me!r} has {len(named)} "
        f"parameters, site {first!r} has {first_count}; sites that differ from {first!r}: "
        f"{others}; {fix}"
    )

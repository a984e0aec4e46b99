"""The cross-site all-reduce: a weighted average of a flat float32 tensor over sites.

This first algorithm is ``direct`` (every site owns a slice): in the
reduce-scatter phase each site sends slice j of its tensor to the owner of j;
the owner reduces the contributions in a fixed order (sorted site names) and
encodes the result *once*; in the all-gather phase it sends those same bytes
to every site and decodes them itself too. Every site therefore ends with
bitwise-identical output, whatever the codec. A value is encoded twice on its
way (once as a contribution, once as the owner's result), so the end-to-end
error is at most two of the codec's bounds (see ``Codec.max_error``).

The caller decides which sites take part and with what weights (the strategy
seals that decision for the round); the engine never decides membership. A
contribution that is not finite, or of the wrong size, is refused with an
error naming the site; a peer that does not deliver by the deadline fails the
round with an error naming the site and its address.

Wire tags: reduce-scatter chunks carry ``shard = j``, all-gather chunks carry
``shard = S + j``, both with the caller's ``round``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from isthmus.inter.chunks import to_chunks
from isthmus.inter.codecs import Codec, Encoded
from isthmus.inter.peer import Identity, PeerClient, PeerError, PeerServer, ReceivedTensor
from isthmus.inter.transport import TransportSettings


class RoundError(RuntimeError):
    """A round could not complete; ``site`` names the site at fault."""

    def __init__(self, site: str, message: str) -> None:
        super().__init__(message)
        self.site = site


@dataclass(frozen=True)
class RoundStats:
    """What one all-reduce moved over the WAN from this rank."""

    bytes_sent: int
    bytes_received: int
    seconds: float


def all_finite(values: torch.Tensor) -> bool:
    """No NaN or Inf in ``values``. Two reductions (NaN propagates through max and
    min) instead of torch.isfinite's full-size boolean temporary: ~10x faster."""
    if values.numel() == 0:
        return True
    return math.isfinite(float(values.amax())) and math.isfinite(float(values.amin()))


def slice_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``count`` values into ``parts`` contiguous slices, sizes differing by <= 1."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class CrossSiteAllReduce:
    """One rank's end of the all-reduce with its counterparts in the other sites."""

    def __init__(
        self,
        identity: Identity,
        peers: Mapping[str, str],
        *,
        codec: Codec | None = None,
        settings: TransportSettings | None = None,
        deadline_s: float = 60.0,
    ) -> None:
        """``peers``: site -> address of this rank's counterpart there."""
        self.identity = identity
        self.peers = dict(peers)
        self.codec = codec or Codec()
        self.settings = settings or TransportSettings()
        self.deadline_s = deadline_s
        sites = {identity.site, *self.peers}
        self.server = PeerServer(identity, sites, self._receive, settings=self.settings)
        self.clients: dict[str, PeerClient] = {}
        self._inbox: dict[tuple[int, int, str], ReceivedTensor] = {}
        self._arrived = asyncio.Event()
        self.last: RoundStats | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        return await self.server.start(host, port)

    async def connect(self) -> None:
        """Open a session with every peer (handshake checks job, protocol, layout)."""
        for site, address in self.peers.items():
            client = PeerClient(
                self.identity, address, settings=self.settings, deadline_s=self.deadline_s
            )
            try:
                await client.hello()
            except PeerError as exc:
                await client.close()
                raise RoundError(site, f"site {site!r}: {exc}") from None
            self.clients[site] = client

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
        await self.server.stop()

    def _receive(self, tensor: ReceivedTensor) -> None:
        self._inbox[(tensor.round, tensor.shard, tensor.site)] = tensor
        self._arrived.set()

    async def _wait_for(self, round: int, shard: int, site: str, deadline: float) -> Encoded:
        loop = asyncio.get_running_loop()
        key = (round, shard, site)
        while key not in self._inbox:
            self._arrived.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise RoundError(
                    site,
                    f"round {round}: nothing from site {site!r} ({self.peers.get(site)}) within "
                    f"{self.deadline_s:g} s; it is down, partitioned or slow",
                )
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                continue
        return self._inbox.pop(key).encoded

    async def _send(self, site: str, encoded: Encoded, *, round: int, shard: int) -> int:
        chunks = to_chunks(
            encoded, round=round, shard=shard, max_chunk_bytes=self.settings.max_chunk_bytes
        )
        try:
            acks = await self.clients[site].exchange(chunks)
        except PeerError as exc:
            raise RoundError(
                site, f"round {round}: sending to site {site!r} failed: {exc}"
            ) from None
        refused = [a for a in acks if not a.ok]
        if refused:
            raise RoundError(site, f"site {site!r} refused chunks: {refused[0].error.message}")
        return sum(len(c.payload) for c in chunks)

    async def allreduce(
        self,
        tensor: torch.Tensor,
        *,
        round: int,
        participants: Sequence[str],
        weights: Mapping[str, float],
    ) -> torch.Tensor:
        """The weighted average of ``tensor`` over ``participants`` (this site among them)."""
        me = self.identity.site
        sites = sorted(participants)
        if me not in sites:
            raise ValueError(f"participants {sites} must include this site {me!r}")
        unknown = [s for s in sites if s != me and s not in self.clients]
        if unknown:
            raise ValueError(f"no session with {unknown}; call connect() first")
        missing = [s for s in sites if not (weights.get(s, 0) > 0)]
        if missing:
            raise ValueError(f"every participant needs a weight > 0; missing or <= 0: {missing}")
        if tensor.dtype != torch.float32:
            raise ValueError(f"expected a float32 tensor, got {tensor.dtype}")
        flat = tensor.detach().reshape(-1).contiguous()
        if not all_finite(flat):
            bad = int((~torch.isfinite(flat)).sum())
            raise RoundError(
                me, f"round {round}: this site's own tensor holds {bad} NaN/Inf values; not sent"
            )
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.deadline_s
        n_sites = len(sites)
        bounds = slice_bounds(flat.numel(), n_sites)
        mine = sites.index(me)
        sent = received = 0

        # Reduce-scatter: slice j goes to its owner, sites[j].
        sends = [
            self._send(owner, self.codec.encode(flat[a:b]), round=round, shard=j)
            for j, (owner, (a, b)) in enumerate(zip(sites, bounds, strict=True))
            if owner != me
        ]
        a, b = bounds[mine]
        contributions: dict[str, torch.Tensor] = {
            me: self.codec.decode(self.codec.encode(flat[a:b]))
        }
        results = await asyncio.gather(
            *sends, *[self._wait_for(round, mine, s, deadline) for s in sites if s != me]
        )
        sent += sum(results[: len(sends)])
        for site, encoded in zip([s for s in sites if s != me], results[len(sends) :], strict=True):
            received += len(encoded.payload)
            contributions[site] = self._check(site, round, encoded, b - a)

        # Reduce in a fixed order, so the result does not depend on arrival order.
        total = sum(weights[s] for s in sites)
        reduced = torch.zeros(b - a, dtype=torch.float64)
        for site in sites:
            reduced += contributions[site].double() * (weights[site] / total)
        owned = self.codec.encode(reduced.float())

        # All-gather: the owner's bytes, decoded by everyone (the owner included).
        sends = [self._send(s, owned, round=round, shard=n_sites + mine) for s in sites if s != me]
        waits = [
            self._wait_for(round, n_sites + j, s, deadline) for j, s in enumerate(sites) if s != me
        ]
        results = await asyncio.gather(*sends, *waits)
        sent += sum(results[: len(sends)])
        out = torch.empty_like(flat)
        self.codec.decode(owned, out=out[a:b])
        others = [(j, s) for j, s in enumerate(sites) if s != me]
        for (j, site), encoded in zip(others, results[len(sends) :], strict=True):
            received += len(encoded.payload)
            lo, hi = bounds[j]
            self._check(site, round, encoded, hi - lo)
            self.codec.decode(encoded, out=out[lo:hi])
        self.last = RoundStats(sent, received, loop.time() - started)
        return out.view_as(tensor)

    def _check(self, site: str, round: int, encoded: Encoded, expected: int) -> torch.Tensor:
        if encoded.count != expected:
            raise RoundError(
                site,
                f"round {round}: site {site!r} sent {encoded.count} values, expected {expected}",
            )
        values = self.codec.decode(encoded)
        if not all_finite(values):
            bad = int((~torch.isfinite(values)).sum())
            raise RoundError(
                site, f"round {round}: site {site!r} sent {bad} NaN/Inf values; refused"
            )
        return values

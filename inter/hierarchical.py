"""The hierarchical step: a site's buffers averaged across sites, every local rank carrying a share.

For one (pipeline, tensor) coordinate, the site's data-parallel ranks hold the
same logical vector: the concatenation, in a fixed order, of the tensors to
synchronise (gradients, or DiLoCo's pseudo-gradients). The step:

1. **in-site reduce-scatter** (only when the ranks hold different values, e.g.
   each replica's own gradients): the weighted in-site average, with each rank
   receiving the block of lanes it owns (:mod:`isthmus.inter.lanes`);
2. **cross-site all-reduce** of every owned lane, with the lane's owner in each
   other site, all lanes and all ranks at once;
3. **in-site all-gather** of the blocks, so every rank holds the whole average,
   written back into its tensors.

The WAN result of a lane is bitwise-identical on every site (the engine
guarantees it), and the all-gather copies bytes, so every rank of every site
ends with the same values.

Sharded inputs (FSDP2's DTensors) are gathered to their full value first
(``full_tensor``): simple and layout-independent, at the cost of holding the
full vector during the step. Redistributing shards straight to lane owners
would avoid that; see docs/ARCHITECTURE.md.

The in-site parts run on the rank's compute device (``device``: NCCL on a GPU);
the cross-site engine takes its lanes on ``wan_device``, the same device as a
site starts it (:func:`isthmus.inter.join.start_site`): the engine encodes
there and only the encoded bytes cross to the host (:mod:`isthmus.inter.staging`).
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

from isthmus.inter.allreduce import RoundStats
from isthmus.inter.background import BackgroundLoop
from isthmus.inter.lanes import RankEndpoint, owned_lanes
from isthmus.intra import collectives

ABORT_POLL_S = 0.1
"""How often a wait that can be abandoned checks whether it must be."""


class RoundAborted(RuntimeError):
    """A round was abandoned by its caller (the membership changed under it)."""


@dataclass(frozen=True)
class StepReport:
    """What one hierarchical step cost this rank."""

    in_site_reduce_s: float
    wan_s: float
    in_site_gather_s: float
    wan_values: int
    """Values of the vector this rank carried across the WAN (its lanes)."""
    wan_bytes_sent: int
    wan_bytes_received: int

    @property
    def in_site_s(self) -> float:
        return self.in_site_reduce_s + self.in_site_gather_s


class HierarchicalStep:
    """One rank's part of the hierarchical step."""

    def __init__(
        self,
        *,
        endpoint: RankEndpoint,
        loop: BackgroundLoop,
        lanes: int,
        dp_rank: int,
        dp_size: int,
        dp_group: dist.ProcessGroup | None = None,
        timeout_s: float | None = None,
        wait_group: dist.ProcessGroup | None = None,
        dp_wait_group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        wan_device: torch.device | str = "cpu",
        algorithm: str = "direct",
    ) -> None:
        """``dp_group``: this rank's data-parallel peers in the site (None with one).
        ``wait_group``, ``dp_wait_group``: the site's ranks and this rank's
        data-parallel peers, for the collectives after the WAN part, where a rank
        waits while the others finish theirs (None: the site group, ``dp_group``).
        ``device``: where this rank computes (its in-site collectives run there);
        ``wan_device``: where the cross-site engine takes its values. ``algorithm``:
        the cross-site all-reduce of every round that names none (the job's)."""
        if dp_size > 1 and dp_group is None:
            raise ValueError("a site with several data-parallel ranks needs their process group")
        if lanes % dp_size:
            raise ValueError(f"{lanes} lanes cannot be dealt evenly to {dp_size} ranks")
        self.endpoint = endpoint
        self.loop = loop
        self.lanes = lanes
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.dp_group = dp_group
        self.timeout_s = timeout_s
        self.wait_group = wait_group
        self.dp_wait_group = dp_wait_group or dp_group
        self.my_lanes = owned_lanes(dp_rank, dp_size, lanes)
        self.device = torch.device(device)
        self.wan_device = torch.device(wan_device)
        self.algorithm = algorithm

    def average(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        round: int,
        participants: Sequence[str],
        weights: Mapping[str, float],
        rank_weight: float = 1.0,
        in_site_reduce: bool = True,
        algorithm: str | None = None,
        abort: Callable[[], bool] | None = None,
        exact: bool = False,
    ) -> StepReport:
        """Replace ``tensors`` (in place) by their weighted average over ``participants``.

        ``weights``: site -> weight (tokens the site saw). ``rank_weight``: this
        rank's weight within its site, when ``in_site_reduce`` says the site's
        ranks hold different values (their weighted average is the site's value).
        Every rank of the data-parallel group must call this with the same arguments
        but ``rank_weight``. ``abort``: see :meth:`PendingAverage.wait`.
        """
        return self.start(
            tensors,
            round=round,
            participants=participants,
            weights=weights,
            rank_weight=rank_weight,
            in_site_reduce=in_site_reduce,
            algorithm=algorithm,
            exact=exact,
        ).wait(abort=abort)

    def start(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        round: int,
        participants: Sequence[str],
        weights: Mapping[str, float],
        rank_weight: float = 1.0,
        in_site_reduce: bool = True,
        algorithm: str | None = None,
        feedback: str | None = None,
        exact: bool = False,
        scale: float = 1.0,
    ) -> PendingAverage:
        """:meth:`average` in two halves, for exchanges that overlap training: the
        in-site reduce-scatter runs now and the WAN part in the background; the
        returned :meth:`PendingAverage.wait` finishes it (every rank of the group
        calls it at the same point). ``tensors`` must not change until then.
        ``feedback``: the engine's error-feedback key for this vector (None: off).
        ``exact``: float32 across the WAN whatever the codec (a seal's vote).
        ``scale``: this rank's values are multiplied by it before they leave (a
        contribution weighted by its site, see :func:`~isthmus.inter.commit.start_seal`);
        the tensors themselves are not touched until the result is written."""
        device = self.device
        local = [_dp_replicated(t) if isinstance(t, DTensor) else t for t in tensors]
        numel = sum(t.numel() for t in local)
        lane_len = math.ceil(numel / self.lanes)
        block_len = lane_len * len(self.my_lanes)
        padded = torch.zeros(lane_len * self.lanes, device=device)
        offset = 0
        for t in local:
            # Straight into the padded buffer on the device (copy_ converts to float32
            # and brings a tensor kept elsewhere, e.g. outer state on the host, over).
            padded[offset : offset + t.numel()].view(t.shape).copy_(t.detach())
            offset += t.numel()
        if scale != 1.0:
            padded.mul_(scale)

        started = time.perf_counter()
        if self.dp_size > 1 and in_site_reduce:
            total = collectives.all_reduce_values(
                [float(rank_weight)],
                group=self.dp_group,
                device=device,
                where="hierarchical.rank_weights",
            )
            padded.mul_(rank_weight / float(total[0]))
            block = torch.empty(block_len, device=device)
            collectives.reduce_scatter_tensor(
                block, padded, group=self.dp_group, device=device, where="hierarchical.reduce"
            )
        else:
            first = self.dp_rank * block_len
            block = padded[first : first + block_len].clone()
        reduced_s = time.perf_counter() - started

        slices, values = {}, {}
        for position, lane in enumerate(self.my_lanes):
            real = max(0, min(lane_len, numel - lane * lane_len))  # the last lanes may be short
            slices[lane] = block[position * lane_len : position * lane_len + real]
            # A view on the engine's own device; a copy (from the GPU) otherwise.
            values[lane] = slices[lane].to(self.wan_device)
        future = self.loop.submit(
            self.endpoint.allreduce_with_stats(
                values,
                round=round,
                participants=participants,
                weights=weights,
                algorithm=algorithm or self.algorithm,
                feedback=feedback,
                exact=exact,
            )
        )
        return PendingAverage(
            self, tensors, slices, values, block, numel, lane_len, future, reduced_s
        )


class PendingAverage:
    """An average whose WAN part is under way; :meth:`wait` completes it."""

    def __init__(
        self,
        step: HierarchicalStep,
        tensors: Sequence[torch.Tensor],
        slices: dict[int, torch.Tensor],
        values: dict[int, torch.Tensor],
        block: torch.Tensor,
        numel: int,
        lane_len: int,
        future: concurrent.futures.Future[tuple[dict[int, torch.Tensor], RoundStats]],
        reduced_s: float,
    ) -> None:
        self._step = step
        self._tensors = tensors
        self._slices = slices
        self._values = values
        self._block = block
        self._numel = numel
        self._lane_len = lane_len
        self._future = future
        self._reduced_s = reduced_s
        self._started = time.perf_counter()

    def done(self) -> bool:
        """Whether the WAN part has finished (waiting would not block on it)."""
        return self._future.done()

    def discard(self) -> None:
        """Give the WAN part up without applying anything (the tensors keep their
        values); every rank of the site discards the same averages."""
        self._future.cancel()

    def wait(self, abort: Callable[[], bool] | None = None) -> StepReport:
        """The average, once the WAN part is done. ``abort``: polled while waiting;
        when it returns True the WAN part is cancelled and :class:`RoundAborted`
        raised (the tensors keep their values)."""
        step = self._step
        if abort is None:
            results, stats = self._future.result(step.timeout_s)
        else:
            results, stats = self._wait_agreed(abort)
        for lane, result in results.items():
            self._slices[lane].copy_(result)  # back into the block, on the device
        wan_s = time.perf_counter() - self._started
        gather_started = time.perf_counter()
        if step.dp_size > 1:
            gathered = torch.empty(self._lane_len * step.lanes, device=step.device)
            collectives.all_gather_into_tensor(
                gathered,
                self._block,
                group=step.dp_wait_group,
                device=step.device,
                where="hierarchical.gather",
            )
        else:
            gathered = self._block
        _write_back(self._tensors, gathered[: self._numel])
        return StepReport(
            in_site_reduce_s=self._reduced_s,
            wan_s=wan_s,
            in_site_gather_s=time.perf_counter() - gather_started,
            wan_values=sum(v.numel() for v in self._values.values()),
            wan_bytes_sent=stats.bytes_sent,
            wan_bytes_received=stats.bytes_received,
        )

    def _wait_agreed(self, abort: Callable[[], bool]) -> tuple[dict[int, torch.Tensor], RoundStats]:
        """:meth:`_wait_unless`, then, in a site of several ranks, agree with the
        others on the outcome before anything is applied: one rank that could not
        finish (abandoned, failed) makes every rank of the site give the round up,
        so the ranks never hold different parameters."""
        try:
            outcome = self._wait_unless(abort)
            error: BaseException | None = None
        except Exception as exc:
            outcome, error = None, exc
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = collectives.all_reduce_values(
                [0 if error is not None else 1],
                op=dist.ReduceOp.MIN,
                group=self._step.wait_group,
                device=self._step.device,
                dtype=torch.int64,
                where="hierarchical.outcome",
            )
            if error is None and not flag.item():
                error = RoundAborted("another rank of this site could not finish the round")
        if error is not None:
            raise error
        assert outcome is not None
        return outcome

    def _wait_unless(self, abort: Callable[[], bool]) -> tuple[dict[int, torch.Tensor], RoundStats]:
        timeout = self._step.timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._future.result(ABORT_POLL_S)
            except concurrent.futures.TimeoutError:
                pass
            if abort():
                self._future.cancel()
                raise RoundAborted("the round was abandoned")
            if deadline is not None and time.monotonic() > deadline:
                self._future.cancel()
                raise TimeoutError(f"the cross-site step did not finish within {timeout:g} s")


def _dp_placements(tensor: DTensor) -> list[Placement]:
    """The tensor's placements with every data-parallel mesh dimension (named
    ``dp*``) replicated; tensor- and pipeline-parallel splits stay."""
    names = tensor.device_mesh.mesh_dim_names or ("dp",) * tensor.device_mesh.ndim
    return [
        Replicate() if name.startswith("dp") else placement
        for name, placement in zip(names, tensor.placements, strict=True)
    ]


def _dp_replicated(tensor: DTensor) -> torch.Tensor:
    """This rank's part of the logical vector: gathered over the data-parallel
    dimensions (FSDP shards), still split over the tensor-parallel one."""
    return tensor.redistribute(tensor.device_mesh, _dp_placements(tensor)).to_local()


def _write_back(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for tensor in tensors:
        if isinstance(tensor, DTensor):
            # Every data-parallel rank holds the same value: each keeps its own
            # shard of it (Replicate -> Shard is a local slice, no communication).
            mesh = tensor.device_mesh
            shape = _dp_replicated_shape(tensor)
            n = math.prod(shape)
            value = flat[offset : offset + n].view(shape).to(tensor.dtype)
            replicated = DTensor.from_local(
                value,
                mesh,
                _dp_placements(tensor),
                run_check=False,
                shape=tensor.shape,
                stride=tensor.stride(),
            )
            with torch.no_grad():
                tensor.to_local().copy_(replicated.redistribute(mesh, tensor.placements).to_local())
        else:
            n = tensor.numel()
            with torch.no_grad():
                tensor.copy_(flat[offset : offset + n].view(tensor.shape).to(tensor.dtype))
        offset += n


def _dp_replicated_shape(tensor: DTensor) -> torch.Size:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, _ = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, _dp_placements(tensor)
    )
    return torch.Size(shape)

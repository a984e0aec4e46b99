"""Synchronous training across sites: gradients averaged before every optimizer step.

Every site takes the same optimizer step, on the gradient averaged over every
site's data, as one model trained on all of it would: the baseline the DiLoCo
family is measured against, and the strategy for links fast enough to carry a
gradient every step. The exchange is overlapped with the backward pass where
it can be (buckets of plain parameters, sent as their gradients are ready).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from isthmus.inter.hierarchical import PendingAverage
from isthmus.inter.join import SiteRuntime, runtime_of
from isthmus.inter.member_rounds import shapes_match
from isthmus.inter.membership import View
from isthmus.inter.state_transfer import StateUnavailable
from isthmus.inter.strategies.base import Strategy, configure, local, settings_doc, static_weights
from isthmus.intra.gradients import clip_grad_norm
from isthmus.job.settings import SettingError
from isthmus.proto import wire_pb2


class Sync(Strategy):
    """Average gradients across sites before every optimizer step.

    Weights are each site's tokens per step (``tokens_per_step`` times its
    data-parallel ranks), fixed by the job's layout, so no seal is needed per
    step. Gradients of FSDP or tensor-parallel models (DTensors) are already
    averaged inside the site; plain gradients of several ranks are averaged
    in the site first (see :mod:`isthmus.inter.hierarchical`).

    With ``overlap`` (plain parameters), gradients go in buckets of about
    ``bucket_mb`` as the backward pass produces them, in the order it produces
    them (the same on every site): the exchange of the last layers' gradients
    runs while the first layers' are still being computed. Overlap assumes one
    backward pass per optimizer step; with gradient accumulation, use
    ``overlap=False``. The averages are the same, bit for bit, either way.

    ``max_grad_norm``: clip the averaged gradient to this norm before the step,
    as a single model trained on every site's data would (a caller cannot: the
    average arrives inside ``optimizer.step()``). Pipeline-parallel sites pass
    ``stage_group``, the ranks holding the other stages, so the norm is the
    whole model's.

    With a membership (``site.membership``), every optimizer step is a round
    (see :mod:`isthmus.inter.member_rounds`): a site lost mid-step makes the
    others run the step's exchange again without it, from the gradients they
    had, and a site that comes back pulls the parameters and the optimizer
    state from a member. The buckets then go after the backward pass, since the
    step's view must be entered (and the state maybe pulled) before anything is
    sent.
    """

    def __init__(
        self,
        site: SiteRuntime,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        tokens_per_step: int = 1,
        bucket_mb: float = 25.0,
        overlap: bool = True,
        stage_group: dist.ProcessGroup | None = None,
        **settings: Any,
    ) -> None:
        settings, codec = configure("sync", settings, site)
        site = runtime_of(site)  # isthmus.join() gives a Site that holds one
        # Not settings of a job: how this class buckets and overlaps its exchanges.
        if not (isinstance(bucket_mb, int | float) and bucket_mb > 0):
            raise SettingError("bucket_mb", f"must be a number > 0, got {bucket_mb!r}")
        self.max_grad_norm = settings.grad_clip or None
        """The averaged gradient's largest norm (``grad_clip``; 0: None, no clipping)."""
        self._stage_group = stage_group
        super().__init__(
            site,
            model,
            optimizer,
            codec=codec,
            tokens_per_step=tokens_per_step,
            error_feedback=settings.error_feedback,
        )
        self.weights = static_weights(self.layouts, tokens_per_step)
        # FSDP sets its sharded gradients itself, after its own reduce-scatter:
        # per-parameter hooks would not see them, so DTensor models do not overlap.
        self.overlap = (
            overlap
            and site.membership is None
            and not any(isinstance(p, DTensor) for p in self.params)
        )
        self.buckets = _buckets(self.params, int(bucket_mb * 2**20))
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self._ready = [0] * len(self.buckets)
        self._pending: list[tuple[int, PendingAverage]] = []
        self._exchanging = False
        """Between the start of a step's exchange and its optimizer step: the only
        time this site's state is that of a round's start, learning rate included."""
        if self.overlap:
            for p in self.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        self._hooks.append(optimizer.register_step_pre_hook(self._before_step))
        if site.membership is not None:
            self._hooks.append(optimizer.register_step_post_hook(self._after_member_step))
        self.member = self._hold_member_rounds(settings.rejoin_timeout_s)

    def _grad_ready(self, param: torch.Tensor) -> None:
        bucket = self._bucket_of[id(param)]
        self._ready[bucket] += 1
        if self._ready[bucket] == len(self.buckets[bucket]):
            self._start(bucket)

    def _bucket_grads(self, bucket: int) -> list[torch.Tensor]:
        grads = []
        for p in self.buckets[bucket]:
            if p.grad is None:  # every site must send the same vector
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        return grads

    def _start(
        self,
        bucket: int,
        weights: dict[str, float] | None = None,
        participants: Sequence[str] | None = None,
    ) -> PendingAverage:
        # Starting an exchange (in-site reduce, flattening, handing it to the engine)
        # runs on the training thread: time it as syncing, not compute.
        with self._blocking("syncing"):
            grads = self._bucket_grads(bucket)
            in_site = not any(isinstance(g, DTensor) for g in grads)
            pending = self._exchange(
                grads,
                self.weights if weights is None else weights,
                vector=f"bucket{bucket}",
                in_site_reduce=in_site,
                participants=participants,
            )
        self._pending.append((bucket, pending))
        return pending

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.member.membership is not None:
            self._step_as_member()
            return
        started = {b for b, _ in self._pending}
        # Buckets the backward pass did not complete (parameters without a
        # gradient this step), in bucket order: the same on every site.
        for bucket in range(len(self.buckets)):
            if bucket not in started:
                self._start(bucket)
        with self._blocking("syncing"):
            for _, pending in self._pending:
                self._account(pending.wait())
        self._pending.clear()
        self._ready = [0] * len(self.buckets)
        self._clip()
        self.inner_steps += 1
        self.outer_steps += 1

    def _clip(self) -> None:
        """Clip the averaged gradient (the same on every site, so clipped alike):
        what clipping before the step means for a model trained as one."""
        if self.max_grad_norm is not None:
            clip_grad_norm(self.params, self.max_grad_norm, self._stage_group)

    # -- membership: every step a round ----------------------------------------------
    def _step_as_member(self) -> None:
        grads = [g for b in range(len(self.buckets)) for g in self._bucket_grads(b)]
        with self._blocking("syncing"):
            own = [g.detach().clone() for g in grads]  # for a step run again
        with self.member.lock:
            self._exchanging = True

        def attempt(view: View, caught_up: bool) -> None:
            with torch.no_grad():
                for grad, mine in zip(grads, own, strict=True):
                    if caught_up:  # gradients of parameters this site no longer holds
                        grad.zero_()
                    else:
                        grad.copy_(mine)
            weights = self.member.weights(view, self.tokens_per_step)
            abort = self.member.abandoned()
            self._pending.clear()
            for bucket in range(len(self.buckets)):
                self._start(bucket, weights, view.members)
            reports = []
            try:
                with self._blocking("syncing"):
                    for _, pending in self._pending:
                        reports.append(pending.wait(abort=abort))
            except BaseException:
                for _, pending in self._pending:
                    pending.discard()
                raise
            finally:
                self._pending.clear()
            for report in reports:
                self._account(report)

        self.member.as_member(attempt, engine_rounds=len(self.buckets))
        self._clip()

    def _after_member_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with self.member.lock:
            self.inner_steps += 1
            self.outer_steps += 1
            self.member.rounds += 1
            self._exchanging = False
            self.member.forget_served()
        self.member.report_done()

    def _global_state(self) -> dict[str, Any]:
        if not self._exchanging:
            raise StateUnavailable(
                wire_pb2.STATE_NOT_READY,
                f"site {self.site.name} has not reached the exchange of step "
                f"{self.member.rounds} yet",
            )
        return {
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "params": [local(p).detach() for p in self.params],
            "optimizer": self.optimizer.state_dict(),
        }

    @torch.no_grad()
    def _load_global_state(self, state: dict[str, Any], donor: str) -> None:
        params = state.get("params")
        shapes_match(self.site.name, donor, (local(p) for p in self.params), params)
        for p, value in zip(self.params, params, strict=True):
            local(p).copy_(value)
        # The donor's learning rate for this step comes with its param_groups.
        self.optimizer.load_state_dict(state["optimizer"])
        self.member.rounds = int(state["rounds"])
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state["outer_steps"])

    def _state_bytes(self) -> int:
        # Parameters and (Adam's) two moments, with room for other optimizers.
        return sum(local(p).numel() * local(p).element_size() for p in self.params) * 4

    def rejoin(self) -> int:
        """For a site that (re)starts while the others train: wait to be admitted, pull
        the parameters and optimizer state, and take the step it was admitted at
        with the others (with no gradients of its own). Returns the step to train on
        from, the same as the other sites'."""
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return self.inner_steps


def _buckets(params: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Parameters in reverse order (roughly the order backward produces their
    gradients), cut into buckets of about ``bucket_bytes``."""
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in reversed(params):
        if buckets[-1] and size + p.numel() * 4 > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * 4
    return [b for b in buckets if b]


Sync.__doc__ = (Sync.__doc__ or "") + settings_doc("sync")

"""The sync strategies: how often and how sites agree on the model.

The user keeps their own training loop; a strategy hooks the optimizer:

* :class:`Sync` averages gradients across sites before every optimizer step
  (the hierarchical all-reduce), so every site takes the same step;
* :class:`DiLoCo` lets every site take ``sync_every`` inner steps, then seals
  the round (participants and weights), averages the pseudo-gradients
  (global minus local parameters) and applies the outer optimizer; the model
  is reset to the new global parameters, bitwise identical on every site;
* :class:`StreamingDiLoCo` does that in fragments at staggered steps, each
  exchange overlapping inner steps and merged with a mixing factor;
* :class:`AsyncDiLoCo` hides each exchange behind the next round's compute
  and applies it one round late.

Round numbers come from the site (one counter per site, advanced identically
everywhere), so strategies can be switched between rounds.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from isthmus.inter.codecs import Codec, parse_codec
from isthmus.inter.commit import Seal, seal_round
from isthmus.inter.fragments import assign_fragments, count_blocks, sync_offsets
from isthmus.inter.hierarchical import PendingAverage, StepReport
from isthmus.inter.join import SiteRuntime
from isthmus.inter.member_rounds import EarlyExchange, MemberRounds, shapes_match
from isthmus.inter.membership import View
from isthmus.inter.outer import OuterOptimizer
from isthmus.inter.settings import SettingError, check_late_contributions
from isthmus.inter.state_transfer import StateUnavailable
from isthmus.intra.gradients import clip_grad_norm
from isthmus.proto import wire_pb2

log = logging.getLogger(__name__)


def _codec(value: str | Codec) -> Codec:
    if isinstance(value, Codec):
        return value
    try:
        return parse_codec(value)
    except ValueError as exc:
        raise SettingError("codec", str(exc)) from None


def _positive_int(name: str, value: Any) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise SettingError(name, f"must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class Blocked:
    """A span during which the training loop waited on the strategy."""

    kind: str
    """``waiting`` (for the other sites to reach the round) or ``syncing`` (moving and
    averaging values)."""
    started: float
    """Wall-clock time (``time.time()``) it began."""
    seconds: float


class Strategy:
    """What every strategy shares: the site, the hooks, and the counters."""

    def __init__(
        self,
        site: SiteRuntime,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        codec: str | Codec,
        tokens_per_step: int,
        error_feedback: bool = False,
    ) -> None:
        if not isinstance(error_feedback, bool):
            raise SettingError("error_feedback", f"must be true or false, got {error_feedback!r}")
        self.error_feedback = error_feedback
        """With a lossy codec, what it lost of this site's values is sent with the
        next exchange of the same values (the engine keeps it per vector)."""
        self.site = site
        self.model = model
        self.optimizer = optimizer
        self._codec = _codec(codec)
        self.tokens_per_step = _positive_int("tokens_per_step", tokens_per_step)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.inner_steps = 0
        self.outer_steps = 0
        self.wan_bytes_sent = 0
        self.wan_bytes_received = 0
        self.last_report: StepReport | None = None
        self.blocked: deque[Blocked] = deque(maxlen=4096)
        """The spans the training loop spent blocked in the strategy, in order (the
        latest 4096: a caller that reports them clears it as it goes)."""
        self.observer: Callable[[str, bool], None] | None = None
        """Called with (kind, True) when a blocked span starts and (kind, False) when it
        ends: live status for a progress display."""
        self._hooks: list[Any] = []
        site.set_codec(self._codec)

    @contextmanager
    def _blocking(self, kind: str) -> Iterator[None]:
        if self.observer is not None:
            self.observer(kind, True)
        started, clock = time.time(), time.perf_counter()
        try:
            yield
        finally:
            self.blocked.append(Blocked(kind, started, time.perf_counter() - clock))
            if self.observer is not None:
                self.observer(kind, False)

    @property
    def codec(self) -> Codec:
        return self._codec

    @codec.setter
    def codec(self, value: str | Codec) -> None:
        """Change the codec from the next exchange on (a plain setting, like
        ``sync_every``; every site should change it at the same round)."""
        self._codec = _codec(value)
        self.site.set_codec(self._codec)

    def _exchange(
        self,
        tensors: Sequence[torch.Tensor],
        weights: dict[str, float],
        *,
        vector: str,
        in_site_reduce: bool = False,
        participants: Sequence[str] | None = None,
    ) -> PendingAverage:
        """Start averaging ``tensors`` over every site, in the site's next round.
        The DiLoCo family's ranks hold one model per site (FSDP, or one rank), so
        by default nothing is averaged inside the site first. ``vector`` names what
        is sent (the same name for the same values every round): error feedback
        is kept per vector. ``participants``: the round's members (default: every
        site of the job)."""
        return self.site.step.start(
            tensors,
            round=self.site.next_round(),
            participants=self.site.names if participants is None else participants,
            weights=weights,
            in_site_reduce=in_site_reduce,
            feedback=vector if self.error_feedback else None,
        )

    def _account(self, report: StepReport) -> None:
        self.wan_bytes_sent += report.wan_bytes_sent
        self.wan_bytes_received += report.wan_bytes_received
        self.last_report = report

    def state_dict(self) -> dict[str, Any]:
        """This rank's state between rounds, for a checkpoint: counters, the round
        number, error feedback and (DiLoCo) the outer optimizer. The model and the
        inner optimizer are the caller's to checkpoint."""
        return {
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "wan_bytes_sent": self.wan_bytes_sent,
            "wan_bytes_received": self.wan_bytes_received,
            "site": self.site.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict` (the same job, layout and strategy)."""
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state["outer_steps"])
        self.wan_bytes_sent = int(state["wan_bytes_sent"])
        self.wan_bytes_received = int(state["wan_bytes_received"])
        self.site.load_state_dict(state["site"])

    def close(self) -> None:
        """Unhook from the optimizer (the site stays joined)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def __enter__(self) -> Strategy:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is None:
                self.finish()
        finally:
            self.close()

    def finish(self) -> None:
        """Bring every site to the same parameters at the end of training."""


class Sync(MemberRounds, Strategy):
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
        codec: str | Codec = "none",
        error_feedback: bool = False,
        tokens_per_step: int = 1,
        bucket_mb: float = 25.0,
        overlap: bool = True,
        rejoin_timeout_s: float = 600.0,
        max_grad_norm: float | None = None,
        stage_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not (isinstance(bucket_mb, int | float) and bucket_mb > 0):
            raise SettingError("bucket_mb", f"must be a number > 0, got {bucket_mb!r}")
        if max_grad_norm is not None and not (
            isinstance(max_grad_norm, int | float) and max_grad_norm > 0
        ):
            raise SettingError(
                "max_grad_norm",
                f"must be a gradient norm > 0 (None: no clipping), got {max_grad_norm!r}",
            )
        self.max_grad_norm = max_grad_norm
        self._stage_group = stage_group
        super().__init__(
            site,
            model,
            optimizer,
            codec=codec,
            tokens_per_step=tokens_per_step,
            error_feedback=error_feedback,
        )
        self._init_member_rounds(rejoin_timeout_s)
        self.weights = _static_weights(site, tokens_per_step)
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
        if self.site.membership is not None:
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
        with self._state_lock:
            self._exchanging = True

        def attempt(view: View, caught_up: bool) -> None:
            with torch.no_grad():
                for grad, mine in zip(grads, own, strict=True):
                    if caught_up:  # gradients of parameters this site no longer holds
                        grad.zero_()
                    else:
                        grad.copy_(mine)
            weights = self._member_weights(view, self.tokens_per_step)
            abort = self._abandoned()
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

        self._as_member(attempt, engine_rounds=len(self.buckets))
        self._clip()

    def _after_member_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with self._state_lock:
            self.inner_steps += 1
            self.outer_steps += 1
            self.rounds += 1
            self._exchanging = False
            self._served = None
        self._report_round_done()

    def _global_state(self) -> dict[str, Any]:
        if not self._exchanging:
            raise StateUnavailable(
                wire_pb2.STATE_NOT_READY,
                f"site {self.site.name} has not reached the exchange of step {self.rounds} yet",
            )
        return {
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "params": [_local(p).detach() for p in self.params],
            "optimizer": self.optimizer.state_dict(),
        }

    @torch.no_grad()
    def _load_global_state(self, state: dict[str, Any], donor: str) -> None:
        params = state.get("params")
        shapes_match(self.site.name, donor, (_local(p) for p in self.params), params)
        for p, value in zip(self.params, params, strict=True):
            _local(p).copy_(value)
        # The donor's learning rate for this step comes with its param_groups.
        self.optimizer.load_state_dict(state["optimizer"])
        self.rounds = int(state["rounds"])
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state["outer_steps"])

    def _state_bytes(self) -> int:
        # Parameters and (Adam's) two moments, with room for other optimizers.
        return sum(_local(p).numel() * _local(p).element_size() for p in self.params) * 4

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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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


class _LocalSteps(MemberRounds, Strategy):
    """What the DiLoCo family shares: ``sync_every`` inner steps between exchanges,
    the outer optimizer, a hook after every inner step (``_after_step``), and the
    outer state as the global state of their membership rounds."""

    def __init__(
        self,
        site: SiteRuntime,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        outer_lr: float,
        outer_momentum: float,
        codec: str | Codec,
        tokens_per_step: int,
        outer_device: str,
        error_feedback: bool,
    ) -> None:
        self.sync_every = _positive_int("sync_every", sync_every)
        self.round_steps = 0
        """Inner steps since the last exchange started: a round ends after exactly
        ``sync_every`` of them, also when ``sync_every`` changes mid-run."""
        _check_outer(outer_lr, outer_momentum)
        super().__init__(
            site,
            model,
            inner_optimizer,
            codec=codec,
            tokens_per_step=tokens_per_step,
            error_feedback=error_feedback,
        )
        self.outer = OuterOptimizer(
            self.params, lr=outer_lr, momentum=outer_momentum, device=outer_device
        )
        self._hooks.append(inner_optimizer.register_step_post_hook(self._after_step))

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        raise NotImplementedError

    def _round_due(self) -> bool:
        """Count an inner step; True when it ends the round."""
        self.round_steps += 1
        if self.round_steps < self.sync_every:
            return False
        self.round_steps = 0
        return True

    @property
    def global_parameters(self) -> Sequence[torch.Tensor]:
        return self.outer.global_params

    def _load_outer_state(self, state: dict[str, Any], donor: str) -> None:
        """Take in a donor's outer state and round counters; the model becomes the
        global one (see :meth:`MemberRounds._load_global_state`)."""
        shapes_match(
            self.site.name,
            donor,
            iter(self.outer.global_params),
            state.get("outer", {}).get("global"),
        )
        self.outer.load_state_dict(state["outer"])
        self.outer.reset_model()
        self.rounds = int(state["rounds"])
        self.outer_steps = int(state["outer_steps"])
        self.round_steps = 0

    def _state_bytes(self) -> int:
        # Parameters and momentum, float32.
        return sum(g.numel() for g in self.outer.global_params) * 4 * 2

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "outer": self.outer.state_dict(),
            "round_steps": self.round_steps,
            "sync_every": self.sync_every,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.outer.load_state_dict(state["outer"])
        self.round_steps = int(state["round_steps"])
        self.sync_every = int(state["sync_every"])


class DiLoCo(_LocalSteps):
    """Local SGD across sites (Douillard et al., 2023): ``sync_every`` inner steps,
    then an outer step on the averaged pseudo-gradient.

    With ``round_seconds``, a round also ends once that much time has passed
    since the last one (``sync_every`` is then the most steps a round takes): a
    slow site takes fewer steps instead of holding the others up, and each
    site's contribution is weighted by the tokens it trained on (the ranks of a
    site agree on the step with a one-value all-reduce per step). Sites then end
    their loops at different steps, so the seal carries who is done: when one
    site's loop ends (leaving the ``with`` block runs its last round), every
    other site learns it at that round and :attr:`training_over` turns True;
    stop the loop then::

        for x, y in loader:
            ...
            inner_optimizer.step()
            if diloco.training_over:
                break
    """

    def __init__(
        self,
        site: SiteRuntime,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int = 50,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        codec: str | Codec = "none",
        error_feedback: bool = False,
        tokens_per_step: int = 1,
        outer_device: str = "cpu",
        round_seconds: float | None = None,
        rejoin_timeout_s: float = 600.0,
    ) -> None:
        if round_seconds is not None and not (
            isinstance(round_seconds, int | float)
            and not isinstance(round_seconds, bool)
            and math.isfinite(round_seconds)
            and round_seconds > 0
        ):
            raise SettingError(
                "round_seconds", f"must be a number of seconds > 0 or None, got {round_seconds!r}"
            )
        self.round_seconds = round_seconds
        self.training_over = False
        """True once a site has said, in a round's seal, that it stopped training."""
        self.last_seal: Seal | None = None
        self._steps_at_round = 0
        self._tokens = 0
        self._round_clock = time.perf_counter()
        super().__init__(
            site,
            model,
            inner_optimizer,
            sync_every=sync_every,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            codec=codec,
            tokens_per_step=tokens_per_step,
            outer_device=outer_device,
            error_feedback=error_feedback,
        )
        self._init_member_rounds(rejoin_timeout_s)

    def __enter__(self) -> DiLoCo:
        self._round_clock = time.perf_counter()  # the first round starts with training
        return self

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.inner_steps += 1
        self._tokens += self.tokens_per_step
        if self._round_due():
            self.sync()

    def _round_due(self) -> bool:
        if super()._round_due():
            return True
        if self.round_seconds is None:
            return False
        over = time.perf_counter() - self._round_clock >= self.round_seconds
        if self.site.site.ranks > 1:
            # Every rank of the site must end the round at the same step, and their
            # clocks differ: the site ends it when its first rank's time is up (a
            # one-value all-reduce per step over the fast fabric).
            flag = torch.tensor([1.0 if over else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            over = bool(flag.item())
        if not over:
            return False
        self.round_steps = 0
        return True

    def add_tokens(self, count: int) -> None:
        """Count tokens beyond ``tokens_per_step`` (batches of varying size)."""
        self._tokens += count

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "tokens": self._tokens,
            "rounds": self.rounds,
            "epoch": self._entered_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._tokens = int(state["tokens"])
        self.rounds = int(state.get("rounds", self.outer_steps))
        self._entered_epoch = int(state.get("epoch", 0))
        self._round_clock = time.perf_counter()

    def sync(self, *, last: bool = False) -> None:
        """Run one round now: seal, average the pseudo-gradients, outer step.
        ``last``: this site stops training after it (``finish`` says so).

        A site whose pseudo-gradient is not finite (on any of its ranks) refuses
        its contribution, and a site with no tokens since the last round has
        none: the seal leaves both out, on every site alike, and they take the
        round's average like the others. If no site has a contribution, the
        global parameters stay as they were.

        With a membership (``site.membership``, which ``isthmus run`` sets up over
        the control plane), the round runs among the members of the view that
        holds for it: a site lost mid-round makes the others run it again
        without it, and a site that rejoins or fell behind pulls the global
        state from a member first (see :mod:`isthmus.inter.membership`)."""
        site = self.site
        if self.training_over:
            seal = self.last_seal
            assert seal is not None
            raise RuntimeError(
                f"site {site.name}: training is over (sites {seal.finished} stopped at seal "
                f"{seal.round}) and the other sites have left; end the training loop when "
                "training_over is True"
            )
        with self._blocking("syncing"):
            deltas = self.outer.pseudo_gradients()
            bad = _nonfinite(deltas)
        if site.membership is None:
            self._round(site.names, deltas, bad, self._tokens, last)
        else:
            self._round_as_member(deltas, bad, last)
        self._tokens = 0
        self._round_clock = time.perf_counter()

    def _round(
        self,
        members: Sequence[str],
        deltas: list[torch.Tensor],
        bad: int,
        tokens: int,
        last: bool,
        abort: Callable[[], bool] | None = None,
    ) -> None:
        """One round among ``members``: seal, average, outer step. With ``abort``,
        raises :class:`RoundAborted` when it says so, before anything is applied."""
        site = self.site
        with self._blocking("waiting"):
            seal = seal_round(
                site.step,
                round=site.next_round(),
                sites=members,
                me=site.name,
                tokens=tokens,
                dp_size=site.layout.dp,
                refuse=bad > 0,
                last=last,
                abort=abort,
            )
        self._account(seal.report)
        self.last_seal = seal
        self.training_over = bool(seal.finished)
        if bad:
            log.warning(
                "site %s: seal %d: this rank's pseudo-gradient holds %d NaN/Inf values; the "
                "site's contribution is left out and its model reset to the global one",
                site.name,
                seal.round,
                bad,
            )
        left_out = {
            s: "refused its contribution (NaN/Inf)" if s in seal.refused else "trained no tokens"
            for s in members
            if s not in seal.participants
        }
        if left_out:
            log.warning(
                "site %s: seal %d: left out of the round: %s", site.name, seal.round, left_out
            )
        if not seal.participants:
            # Nothing to average (every site took the same decision): start the
            # next round from the global parameters as they were.
            with self._state_lock:
                self.outer.reset_model()
                self._count_round(stepped=False)
            return
        with self._blocking("syncing"):
            # Left out: sent, but not counted (weight 0). Zeros in place of the
            # values, which a round run again may still need.
            sent = (
                deltas if site.name in seal.participants else [torch.zeros_like(d) for d in deltas]
            )
            pending = self._exchange(sent, seal.weights, vector="model", participants=members)
            report = pending.wait(abort=abort)
            with self._state_lock:
                self.outer.step(sent)
                self._count_round(stepped=True)
        self._account(report)

    def _count_round(self, *, stepped: bool) -> None:
        """Under the state lock: a round is complete."""
        self.outer_steps += stepped
        self.rounds += 1
        self._steps_at_round = self.inner_steps

    # -- membership: site loss, rejoin, quorum ---------------------------------------
    def _round_as_member(self, deltas: list[torch.Tensor], bad: int, last: bool) -> None:
        """The round under the membership view that holds for it (see
        :mod:`isthmus.inter.member_rounds`); a site that catches up takes part with
        nothing (zero pseudo-gradient, no tokens)."""
        tokens = self._tokens

        def attempt(view: View, caught_up: bool) -> None:
            if caught_up:  # the model is the pulled global one: zeros
                self._round(
                    view.members, self.outer.pseudo_gradients(), 0, 0, last, abort=self._abandoned()
                )
            else:
                self._round(view.members, deltas, bad, tokens, last, abort=self._abandoned())

        if self._as_member(attempt):
            # The others trained this round's steps while this site took part with
            # nothing: go on from where they are.
            self.inner_steps += self.sync_every
        self._report_round_done()

    def _global_state(self) -> dict[str, Any]:
        return {
            "outer_steps": self.outer_steps,
            "inner_steps": self._steps_at_round,
            "sync_every": self.sync_every,
            "outer": self.outer.state_dict(),
        }

    def _load_global_state(self, state: dict[str, Any], donor: str) -> None:
        self._load_outer_state(state, donor)
        self.inner_steps = int(state["inner_steps"])
        self._steps_at_round = self.inner_steps
        self.sync_every = int(state["sync_every"])
        self._tokens = 0

    def rejoin(self) -> int:
        """For a site that (re)starts while the others train: wait to be admitted,
        pull the global state, and take part in the round it was admitted at (with
        nothing of its own to contribute). Returns the inner step to train on from,
        the same as the other sites'."""
        self._tokens = 0
        deltas = self.outer.pseudo_gradients()
        self._round_as_member([d.zero_() for d in deltas], 0, False)
        self._round_clock = time.perf_counter()
        return self.inner_steps

    def finish(self) -> None:
        """The last round, for the steps since the previous one. With time-budgeted
        rounds it always runs: it tells the other sites that training is over."""
        if self.training_over:
            return  # the round that said so was the last one
        if self._tokens or self.round_seconds is not None:
            self.sync(last=True)


def _nonfinite(tensors: Sequence[torch.Tensor]) -> int:
    """How many values of ``tensors`` are NaN or infinite."""
    return sum(int(t.numel() - torch.isfinite(t).sum()) for t in tensors)


def _static_weights(site: SiteRuntime, tokens_per_step: int) -> dict[str, float]:
    """Weights known to every site from the layout: sites step in lock-step here."""
    return {s.name: float(tokens_per_step * s.layout.dp) for s in site.job.sites}


class _BackgroundExchanges(_LocalSteps):
    """Async and Streaming DiLoCo: exchanges that run behind the training, with
    weights fixed by the layout (all sites take the same steps between them)."""

    weights: dict[str, float]

    def _exchange_in_view(
        self, deltas: list[torch.Tensor], vector: str, view: View | None
    ) -> PendingAverage:
        """Start averaging ``deltas``: among every site, or the members of ``view``."""
        if view is None:
            return self._exchange(deltas, self.weights, vector=vector)
        weights = self._member_weights(view, self.tokens_per_step)
        return self._exchange(deltas, weights, vector=vector, participants=view.members)

    def _complete_round(
        self,
        early: EarlyExchange,
        restart: Callable[[View, bool], PendingAverage],
        apply: Callable[[StepReport, bool], None],
    ) -> bool:
        """Wait for the exchange ``early`` started and ``apply`` it; under a
        membership, as :meth:`MemberRounds._complete_as_member` (``restart`` runs it
        again). Returns whether this site caught up meanwhile."""
        if self.membership is None:
            assert early.pending is not None
            with self._blocking("syncing"):
                apply(early.pending.wait(), False)
            return False
        return self._complete_as_member(early, restart, apply)

    def _final_round(self, deltas: list[torch.Tensor], indices: Sequence[int] | None) -> None:
        """The closing exchange of ``indices`` (all parameters by default) as a round
        under the membership, every model reset to the global parameters after it."""
        sent = deltas

        def restart(view: View, caught_up: bool) -> PendingAverage:
            nonlocal sent
            if caught_up:  # the model is the pulled global one: nothing of its own
                sent = self.outer.pseudo_gradients(indices)
            return self._exchange_in_view(sent, "final", view)

        def apply(report: StepReport, caught_up: bool) -> None:
            self._account(report)
            with self._state_lock:
                self.outer.step(sent, indices)
                self.outer_steps += 1
                self.rounds += 1

        self._complete_as_member(EarlyExchange(None, epoch=-1), restart, apply)


class StreamingDiLoCo(_BackgroundExchanges):
    """Streaming DiLoCo (Douillard et al., 2025): DiLoCo in ``fragments`` parts that
    sync at staggered steps, each exchange overlapping ``overlap_steps`` inner steps,
    the result merged into the local parameters with mixing factor ``alpha``
    (``local = alpha * local + (1 - alpha) * global``).

    Lower-precision codecs (e.g. ``int4``) suit it: values are decoded and
    accumulated in float32. All sites take the same number of inner steps between
    exchanges, so the weights come from the layout (tokens per step times ranks).

    With a membership (``site.membership``), each fragment's exchange is a round
    (see :mod:`isthmus.inter.member_rounds`): it starts under the view that holds
    for it and, if that view is replaced or a member is lost while it is in
    flight, it is run again when it is due, from the pseudo-gradient this site
    sent. The schedule fixes at which step round ``r`` starts, so a site that
    catches up needs only the outer state and the round count.
    """

    def __init__(
        self,
        site: SiteRuntime,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int = 50,
        fragments: int = 2,
        overlap_steps: int = 0,
        alpha: float = 0.5,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        codec: str | Codec = "none",
        error_feedback: bool = False,
        tokens_per_step: int = 1,
        outer_device: str = "cpu",
        rejoin_timeout_s: float = 600.0,
    ) -> None:
        _positive_int("sync_every", sync_every)  # checked here: the checks below use it
        self.fragments = _positive_int("fragments", fragments)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        blocks = count_blocks(names)
        if fragments > max(1, blocks):
            raise SettingError(
                "fragments",
                f"{fragments} fragments, but the model has {blocks} layers (numbered blocks); "
                f"use fragments <= {max(1, blocks)}",
            )
        if fragments > sync_every:
            raise SettingError(
                "fragments", f"{fragments} fragments cannot sync within sync_every={sync_every}"
            )
        if not (isinstance(overlap_steps, int) and 0 <= overlap_steps < sync_every / fragments):
            raise SettingError(
                "overlap_steps",
                f"must be an integer in [0, sync_every / fragments) = [0, "
                f"{sync_every / fragments:g}) so one fragment's exchange ends before the next "
                f"starts, got {overlap_steps!r}",
            )
        if not (isinstance(alpha, int | float) and 0 <= alpha <= 1):
            raise SettingError("alpha", f"must be in [0, 1], got {alpha!r}")
        super().__init__(
            site,
            model,
            inner_optimizer,
            sync_every=sync_every,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            codec=codec,
            tokens_per_step=tokens_per_step,
            outer_device=outer_device,
            error_feedback=error_feedback,
        )
        self.overlap_steps = overlap_steps
        self.alpha = float(alpha)
        assignment = assign_fragments(names, fragments)
        self.members = [[i for i, f in enumerate(assignment) if f == p] for p in range(fragments)]
        self.offsets = sync_offsets(sync_every, fragments)
        self.weights = _static_weights(site, tokens_per_step)
        self._in_flight: list[_FragmentExchange] = []
        """At most one: an exchange ends before the next one starts."""
        self._started_at = [0] * fragments
        """The inner step at which each fragment's last exchange started."""
        self._resume: dict[str, Any] | None = None
        """An exchange a checkpoint caught in flight, to start again (see
        :meth:`load_state_dict`)."""
        self._init_member_rounds(rejoin_timeout_s)

    def state_dict(self) -> dict[str, Any]:
        """Also what is in flight: the fragment's pseudo-gradient, and the site's
        round counter and error feedback as they were when it started (a resumed
        run starts it again from there)."""
        state = {
            **super().state_dict(),
            "rounds": self.rounds,
            "started_at": list(self._started_at),
        }
        for flight in self._in_flight:
            state["site"] = flight.site_state
            state["in_flight"] = {
                "fragment": flight.fragment,
                "due": flight.due,
                "sent": flight.sent,
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`; an exchange it caught in flight starts again
        at the next step, with the values and round number it had."""
        super().load_state_dict(state)
        self.rounds = int(state["rounds"])
        self._started_at = [int(step) for step in state["started_at"]]
        self._resume = state.get("in_flight")

    def round_start(self, rounds: int) -> tuple[int, int]:
        """``(fragment, inner step)`` at which round ``rounds`` (counted from 0) starts:
        fragments take turns in order, each at its offset in every period."""
        period, fragment = divmod(rounds, self.fragments)
        return fragment, period * self.sync_every + self.offsets[fragment]

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.inner_steps += 1
        if self._resume is not None:
            resumed, self._resume = self._resume, None
            self._start(int(resumed["fragment"]), resumed)
        for flight in list(self._in_flight):
            if flight.due <= self.inner_steps and self._complete(flight):
                return  # caught up: this site now stands where that round started
        position = (self.inner_steps - 1) % self.sync_every + 1
        for fragment, offset in enumerate(self.offsets):
            if offset == position and self._start(fragment):
                return

    def _start(self, fragment: int, resumed: dict[str, Any] | None = None) -> bool:
        """Start the fragment's exchange (and complete it at once without overlap),
        or the one a checkpoint caught in flight (``resumed``). Returns whether this
        site caught up (its step changed)."""
        view = None
        if self.membership is not None:
            view, _ = self._open_round()
            # A site that caught up to the round goes on with its fragment and step.
            fragment = self.rounds % self.fragments
        site_state = self.site.state_dict(copy=False)
        with self._blocking("syncing"):  # host work on the training thread
            if resumed is None:
                self._started_at[fragment] = self.inner_steps
                deltas = self.outer.pseudo_gradients(self.members[fragment])
                due = self.inner_steps + self.overlap_steps
            else:
                deltas, due = list(resumed["sent"]), int(resumed["due"])
            pending = self._exchange_in_view(deltas, f"fragment{fragment}", view)
        flight = _FragmentExchange(
            due,
            fragment,
            deltas,
            EarlyExchange(pending, view.epoch if view is not None else 0),
            site_state,
        )
        if self.overlap_steps == 0:
            return self._complete(flight)
        self._in_flight.append(flight)
        return False

    def _complete(self, flight: _FragmentExchange) -> bool:
        """Wait for the fragment's exchange and merge it; returns whether this site
        caught up meanwhile (then it stands at the step the round started)."""
        self._in_flight = [f for f in self._in_flight if f is not flight]

        def apply(report: StepReport, caught_up: bool) -> None:
            self._account(report)
            with self._state_lock:
                self.outer.step(flight.sent, self.members[flight.fragment], mix=self.alpha)
                self.outer_steps += 1
                self.rounds += 1

        def restart(view: View, caught_up: bool) -> PendingAverage:
            if caught_up:
                # The pulled state may be a round or more past this flight's: the
                # round to run is the next one of the schedule, with nothing of this
                # site's (its model is the pulled global one).
                flight.fragment = self.rounds % self.fragments
                flight.sent = self.outer.pseudo_gradients(self.members[flight.fragment])
            return self._exchange_in_view(flight.sent, f"fragment{flight.fragment}", view)

        return self._complete_round(flight.early, restart, apply)

    def _global_state(self) -> dict[str, Any]:
        return {"outer_steps": self.outer_steps, "outer": self.outer.state_dict()}

    def _load_global_state(self, state: dict[str, Any], donor: str) -> None:
        self._load_outer_state(state, donor)
        _, self.inner_steps = self.round_start(self.rounds)
        for earlier in range(max(0, self.rounds - self.fragments + 1), self.rounds + 1):
            fragment, step = self.round_start(earlier)
            self._started_at[fragment] = step

    def rejoin(self) -> int:
        """For a site that (re)starts while the others train: wait to be admitted, pull
        the global state, and start the round it was admitted at (with nothing of its
        own to send). Returns the inner step to train on from, the same as the others'."""
        self._start(0)
        return self.inner_steps

    def finish(self) -> None:
        """Complete what is in flight, then one exchange of every parameter (no
        mixing), so every site ends with the same, global, parameters."""
        for flight in list(self._in_flight):
            self._complete(flight)
        # A fragment exchanged at the last step with no mixing already holds the
        # global parameters exactly: leave it (an outer step on its zero
        # pseudo-gradient would still move it, by momentum). Every other one is
        # exchanged once more and reset to the global parameters.
        done = {
            f
            for f, step in enumerate(self._started_at)
            if step == self.inner_steps and self.alpha == 0
        }
        everything = [i for f, members in enumerate(self.members) if f not in done for i in members]
        if not everything:
            return
        with self._blocking("syncing"):
            deltas = self.outer.pseudo_gradients(everything)
        if self.membership is None:
            with self._blocking("syncing"):
                self._account(self._exchange(deltas, self.weights, vector="final").wait())
                self.outer.step(deltas, everything)
            return
        self._final_round(deltas, everything)


@dataclass
class _FragmentExchange:
    due: int
    """The inner step at which it is completed."""
    fragment: int
    sent: list[torch.Tensor]
    """This site's pseudo-gradient of the fragment (the average, once completed)."""
    early: EarlyExchange
    site_state: dict[str, Any]
    """The site's round counter and error feedback before it started: a checkpoint
    that catches it in flight goes back to them."""


class AsyncDiLoCo(_BackgroundExchanges):
    """DiLoCo whose exchange hides behind the next round's compute.

    At the end of round k the pseudo-gradient leaves in the background and the
    site keeps training; at the end of round k + 1 the averaged pseudo-gradient
    of round k is applied to the global parameters (one round late: delayed
    Nesterov), and the local progress made meanwhile is kept on top of them
    (``local = global + (local - local at the send)``), so no compute is lost.
    The global parameters stay bitwise identical on every site.

    With a membership (``site.membership``), each exchange is a round (see
    :mod:`isthmus.inter.member_rounds`) that starts under the view holding for
    it; if that view is replaced or a member is lost while it is in flight, it
    is run again when it is due, from the pseudo-gradient this site sent. A site
    that catches up pulls the outer state and the step at which the others sent
    the round, takes part in it at once with nothing of its own, and trains on
    from that step.

    A site that missed a round (``round_deadline_s`` passed and the others went
    on without it) had sent a pseudo-gradient that no one applied. With
    ``late_contributions="drop"`` it is lost; with ``"stale"`` the site adds it,
    times ``staleness_weight``, to its next contribution, so its compute still
    counts, one round late and damped. Either way the global parameters stay the
    same everywhere: a contribution is only ever this site's own vector in an
    average that every member computes alike.
    """

    def __init__(
        self,
        site: SiteRuntime,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int = 50,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        codec: str | Codec = "none",
        error_feedback: bool = False,
        tokens_per_step: int = 1,
        outer_device: str = "cpu",
        rejoin_timeout_s: float = 600.0,
        late_contributions: str = "drop",
        staleness_weight: float = 0.5,
    ) -> None:
        check_late_contributions(late_contributions, staleness_weight)
        self.late_contributions = late_contributions
        self.staleness_weight = float(staleness_weight)
        self.late_contributions_applied = 0
        """Late pseudo-gradients this site added to a later contribution."""
        self._late: list[torch.Tensor] | None = None
        """This site's pseudo-gradient of a round it missed, until its next send."""
        self._flight: _AsyncExchange | None = None
        super().__init__(
            site,
            model,
            inner_optimizer,
            sync_every=sync_every,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            codec=codec,
            tokens_per_step=tokens_per_step,
            outer_device=outer_device,
            error_feedback=error_feedback,
        )
        self.weights = _static_weights(site, tokens_per_step)
        self._sent_at = 0
        """The inner step at which the exchange in flight was sent."""
        self._resume: dict[str, Any] | None = None
        """The exchange a checkpoint caught in flight, to send again (see
        :meth:`load_state_dict`)."""
        self._init_member_rounds(rejoin_timeout_s)

    def state_dict(self) -> dict[str, Any]:
        """Also the exchange in flight: the pseudo-gradient sent, the local
        parameters at the send, and the site's round counter and error feedback as
        they were before it (a resumed run sends it again from there); and a missed
        round's pseudo-gradient still to be carried (``late_contributions="stale"``)."""
        state = {**super().state_dict(), "rounds": self.rounds, "sent_at": self._sent_at}
        if self._late is not None:
            state["late"] = self._late
        if self._flight is not None:
            state["site"] = self._flight.site_state
            state["in_flight"] = {"sent": self._flight.sent, "anchor": self._flight.anchor}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`; the exchange it caught in flight is sent again
        at the next step, with the values and round number it had."""
        super().load_state_dict(state)
        self.rounds = int(state["rounds"])
        self._sent_at = int(state["sent_at"])
        self._resume = state.get("in_flight")
        self._late = state.get("late")

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.inner_steps += 1
        if self._resume is not None:
            resumed, self._resume = self._resume, None
            self._send(resumed)
        if self._round_due():
            if self._complete():
                return  # caught up: this site now stands where the others sent the round
            self._send()

    def _send(self, resumed: dict[str, Any] | None = None) -> None:
        """Send this round's pseudo-gradient in the background (under the view that
        holds for it, entered first), or the one a checkpoint caught in flight."""
        view = None
        if self.membership is not None:
            view, _ = self._open_round()  # a site that caught up has the global model
        site_state = self.site.state_dict(copy=False)
        with self._blocking("syncing"):  # host work on the training thread
            if resumed is None:
                deltas = self.outer.pseudo_gradients()
                anchor = [p.detach().clone() for p in self.params]
                if self._late is not None:
                    for d, late in zip(deltas, self._late, strict=True):
                        d.add_(late.to(d.device, d.dtype), alpha=self.staleness_weight)
                    self._late = None
                    self.late_contributions_applied += 1
                    log.info(
                        "site %s: round %d carries this site's missed round's "
                        "pseudo-gradient at weight %g",
                        self.site.name,
                        self.rounds,
                        self.staleness_weight,
                    )
            else:
                deltas, anchor = list(resumed["sent"]), list(resumed["anchor"])
            pending = self._exchange_in_view(deltas, "model", view)
        with self._state_lock:
            self._flight = _AsyncExchange(
                deltas,
                anchor,
                EarlyExchange(pending, view.epoch if view is not None else 0),
                site_state,
            )
            if resumed is None:
                self._sent_at = self.inner_steps

    @torch.no_grad()
    def _complete(self) -> bool:
        """Apply the exchange in flight, if any; returns whether this site caught up
        meanwhile (then it stands at the step the others sent the round at)."""
        flight = self._flight
        if flight is None:
            return False

        def apply(report: StepReport, caught_up: bool) -> None:
            self._account(report)
            with self._state_lock:
                self._flight = None
                if caught_up:  # the model is the pulled global one
                    self.outer.step(flight.sent)
                else:
                    self.outer.step(flight.sent, reset=False)
                    for p, g, a in zip(
                        self.params, self.outer.global_params, flight.anchor, strict=True
                    ):
                        p.add_(g.to(p.device, p.dtype) - a)  # local = global + progress since
                self.outer_steps += 1
                self.rounds += 1

        def restart(view: View, caught_up: bool) -> PendingAverage:
            if caught_up and flight.own:  # the others' round, with nothing of this site's
                if self.late_contributions == "stale":
                    self._late = flight.sent
                    log.warning(
                        "site %s: missed round %d; its pseudo-gradient (norm %.6g) goes into "
                        "its next contribution at weight %g (late_contributions: stale)",
                        self.site.name,
                        self.rounds,
                        math.sqrt(sum(float(t.double().square().sum()) for t in flight.sent)),
                        self.staleness_weight,
                    )
                flight.sent = self.outer.pseudo_gradients()
                flight.own = False
            return self._exchange_in_view(flight.sent, "model", view)

        return self._complete_round(flight.early, restart, apply)

    def _global_state(self) -> dict[str, Any]:
        if self._flight is None:
            # Between applying a round and sending the next (a site that caught up
            # sends it a round's steps later): not the state of a round's start.
            raise StateUnavailable(
                wire_pb2.STATE_NOT_READY,
                f"site {self.site.name} has not sent round {self.rounds} yet",
            )
        return {
            "outer_steps": self.outer_steps,
            "sent_at": self._sent_at,
            "sync_every": self.sync_every,
            "outer": self.outer.state_dict(),
        }

    def _load_global_state(self, state: dict[str, Any], donor: str) -> None:
        self._load_outer_state(state, donor)
        self.inner_steps = self._sent_at = int(state["sent_at"])
        self.sync_every = int(state["sync_every"])

    def rejoin(self) -> int:
        """For a site that (re)starts while the others train: wait to be admitted, pull
        the global state, and take part in the round it was admitted at (with nothing
        of its own to send). Returns the inner step to train on from: where the others
        sent that round."""
        self._send()
        self._complete()
        return self.inner_steps

    def finish(self) -> None:
        """Apply what is in flight, then one synchronous round for the steps taken
        since the last send, so every site ends with the same, global, parameters."""
        self._complete()
        if self.round_steps == 0:
            # No steps since the last send: the model is the global one, up to
            # the rounding of global + (local - anchor); make it exact.
            self.outer.reset_model()
            return
        with self._blocking("syncing"):
            deltas = self.outer.pseudo_gradients()
        if self.membership is None:
            with self._blocking("syncing"):
                self._account(self._exchange(deltas, self.weights, vector="final").wait())
                self.outer.step(deltas)
            self.outer_steps += 1
            return
        self._final_round(deltas, None)


@dataclass
class _AsyncExchange:
    sent: list[torch.Tensor]
    """This site's pseudo-gradient (the average, once completed)."""
    anchor: list[torch.Tensor]
    """The local parameters when it was sent."""
    early: EarlyExchange
    site_state: dict[str, Any]
    """The site's round counter and error feedback before it was sent: a checkpoint
    that catches it in flight goes back to them."""
    own: bool = True
    """Whether ``sent`` is still this site's own pseudo-gradient (not the zeros of a
    site that caught up and takes part with nothing of its own)."""


def _check_outer(outer_lr: Any, outer_momentum: Any) -> None:
    if not (isinstance(outer_lr, int | float) and math.isfinite(outer_lr) and outer_lr > 0):
        raise SettingError("outer_lr", f"must be a number > 0, got {outer_lr!r}")
    if not (isinstance(outer_momentum, int | float) and 0 <= outer_momentum < 1):
        raise SettingError("outer_momentum", f"must be in [0, 1), got {outer_momentum!r}")

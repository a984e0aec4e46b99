"""What every strategy shares: the hooks on the optimizer, the exchange, the counters.

A strategy is built on a joined site (:class:`~isthmus.inter.join.SiteRuntime`),
the user's model and optimizer; it hooks the optimizer so the user's training
loop stays as it is. :class:`Strategy` holds what every strategy needs: the
site's exchange engine (one call starts an average over the sites), the spans
in which the training loop waited on it (:attr:`Strategy.blocked`), the WAN
byte counters, and its :class:`~isthmus.inter.member_rounds.MemberRounds`,
which runs each round under the membership view that holds for it.

Settings are checked by their one definition, :class:`TrainSettings`
(:func:`configure`), so a job file and a script calling the API get the same
message for the same mistake.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from isthmus.inter.codecs import Codec, parse_codec
from isthmus.inter.hierarchical import PendingAverage, StepReport
from isthmus.inter.join import SiteRuntime, runtime_of
from isthmus.inter.member_rounds import MemberRounds
from isthmus.inter.membership import View
from isthmus.job.layout import Layout
from isthmus.job.settings import SettingError, TrainSettings, strategy_keys, strategy_settings


def configure(strategy: str, given: dict[str, Any], site: Any) -> tuple[Any, str | Codec]:
    """A strategy's keyword arguments checked as a job file's ``train:`` section is
    checked (the same rules, defaults and messages:
    :func:`isthmus.job.settings.strategy_settings`), before anything is built.
    The rules between fields see the site's job (its round deadline, ...). Returns
    the settings and the codec: a :class:`Codec` object given as ``codec`` is the
    caller's own, already valid (and then error feedback is off unless asked for)."""
    given = dict(given)
    own = given.get("codec")
    if isinstance(own, Codec):
        given["codec"] = "none"
        given.setdefault("error_feedback", False)
    job = getattr(runtime_of(site), "job", None)
    settings = strategy_settings(strategy, given, getattr(job, "train", None))
    return settings, own if isinstance(own, Codec) else settings.codec


def settings_doc(strategy: str) -> str:
    """The keyword settings a strategy class takes, with their defaults: appended to
    its docstring, so ``help()`` shows what the job file's defaults are."""
    defaults = TrainSettings(strategy=strategy)
    lines = [f"    {name}={getattr(defaults, name)!r}" for name in strategy_keys(strategy)]
    return (
        "\n\n    Settings (keyword arguments; the job file's ``train:`` keys, with its "
        "defaults and checks: docs/job-file.md):\n\n" + "\n".join(lines) + "\n"
    )


def parsed_codec(value: str | Codec) -> Codec:
    if isinstance(value, Codec):
        return value
    try:
        return parse_codec(value)
    except ValueError as exc:
        raise SettingError("codec", str(exc)) from None


def check_tokens_per_step(value: Any) -> int:
    # Not a job-file setting: ``isthmus run`` derives it from the batch.
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise SettingError("tokens_per_step", f"must be an integer >= 1, got {value!r}")
    return value


def site_layouts(site: SiteRuntime) -> dict[str, Layout]:
    """Every site's layout, by name, in the job file's order."""
    return {s.name: s.layout for s in site.job.sites}


def static_weights(layouts: dict[str, Layout], tokens_per_step: int) -> dict[str, float]:
    """Weights known to every site from the layout: sites step in lock-step here."""
    return {name: float(tokens_per_step * layout.dp) for name, layout in layouts.items()}


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP, tensor parallel), or the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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
    """What every strategy shares: the site, the hooks, and the counters.

    Subclasses build their :class:`MemberRounds` last in ``__init__``
    (:meth:`_hold_member_rounds`) and say what their global state is
    (:meth:`_global_state`, :meth:`_load_global_state`, :meth:`_state_bytes`)."""

    member: MemberRounds
    """The rounds under membership views (and their count, with or without one)."""

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
        self.error_feedback = error_feedback
        """With a lossy codec, what it lost of this site's values is sent with the
        next exchange of the same values (the engine keeps it per vector)."""
        self.site = site
        self.layouts = site_layouts(site)
        """Every site's layout: who takes part, and with how many data-parallel ranks."""
        self.model = model
        self.optimizer = optimizer
        self._codec = parsed_codec(codec)
        self.tokens_per_step = check_tokens_per_step(tokens_per_step)
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

    def _hold_member_rounds(self, rejoin_timeout_s: float) -> MemberRounds:
        """This strategy's membership rounds. Built last in ``__init__``: from then on a
        peer may pull this strategy's global state through it."""
        return MemberRounds(
            self.site,
            layouts=self.layouts,
            timeout_s=rejoin_timeout_s,
            blocking=self._blocking,
            global_state=self._global_state,
            load_global_state=self._load_global_state,
            state_bytes=self._state_bytes,
        )

    # -- what each strategy says about its global state ------------------------------
    def _global_state(self) -> dict[str, Any]:
        """(State lock held.) What a catching-up site needs to go on from this one
        after ``member.rounds`` rounds; may raise :class:`StateUnavailable`
        (STATE_NOT_READY) while it is not yet consistent."""
        raise NotImplementedError

    def _load_global_state(self, state: dict[str, Any], donor: str) -> None:
        """(State lock held.) Take in what :meth:`_global_state` gave on ``donor``
        (its ``rounds`` included); raise :class:`MembershipError` if it cannot be
        this site's."""
        raise NotImplementedError

    def _state_bytes(self) -> int:
        """About how many bytes :meth:`_global_state` serialises to (a transfer larger
        than this, with room for framing, is refused)."""
        raise NotImplementedError

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
        self._codec = parsed_codec(value)
        self.site.set_codec(self._codec)

    def _exchange(
        self,
        tensors: Sequence[torch.Tensor],
        weights: dict[str, float],
        *,
        vector: str | None,
        in_site_reduce: bool = False,
        participants: Sequence[str] | None = None,
        scale: float = 1.0,
    ) -> PendingAverage:
        """Start averaging ``tensors`` over every site, in the site's next round.
        The DiLoCo family's ranks hold one model per site (FSDP, or one rank), so
        by default nothing is averaged inside the site first. ``vector`` names what
        is sent (the same name for the same values every round): error feedback
        is kept per vector; None sends without it (a site whose values do not
        count this round: what the codec lost last time waits for one that does).
        ``participants``: the round's members (default: every site of the job).
        ``scale``: see :meth:`HierarchicalStep.start`."""
        return self.site.step.start(
            tensors,
            round=self.site.next_round(),
            participants=list(self.layouts) if participants is None else participants,
            weights=weights,
            in_site_reduce=in_site_reduce,
            feedback=vector if self.error_feedback else None,
            scale=scale,
        )

    def _exchange_in_view(
        self,
        tensors: Sequence[torch.Tensor],
        weights: dict[str, float],
        *,
        vector: str,
        view: View | None,
        in_site_reduce: bool = False,
    ) -> PendingAverage:
        """Start averaging ``tensors`` with the weights fixed by the layout
        (``weights``): among every site, or among the members of ``view`` with the
        weights it implies (see :meth:`MemberRounds.weights`)."""
        if view is None:
            return self._exchange(tensors, weights, vector=vector, in_site_reduce=in_site_reduce)
        return self._exchange(
            tensors,
            self.member.weights(view, self.tokens_per_step),
            vector=vector,
            in_site_reduce=in_site_reduce,
            participants=view.members,
        )

    def _account(self, report: StepReport) -> None:
        self.wan_bytes_sent += report.wan_bytes_sent
        self.wan_bytes_received += report.wan_bytes_received
        self.last_report = report

    def state_dict(self) -> dict[str, Any]:
        """This rank's state between rounds, for a checkpoint: counters, the site's
        round number and error feedback, the membership rounds and (DiLoCo) the outer
        optimizer. The model and the inner optimizer are the caller's to checkpoint."""
        return {
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "wan_bytes_sent": self.wan_bytes_sent,
            "wan_bytes_received": self.wan_bytes_received,
            "site": self.site.state_dict(),
            "member": self.member.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict` (the same job, layout and strategy)."""
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state["outer_steps"])
        self.wan_bytes_sent = int(state["wan_bytes_sent"])
        self.wan_bytes_received = int(state["wan_bytes_received"])
        self.site.load_state_dict(state["site"])
        # Checkpoints written before the rounds were held apart kept them at the top
        # level (and Sync not at all: its rounds were its outer steps).
        member = state.get("member") or {
            "rounds": state.get("rounds", state["outer_steps"]),
            "epoch": state.get("epoch", 0),
        }
        self.member.load_state_dict(member)

    def rejoin(self) -> int:
        """For a site that (re)starts while the others train: wait to be admitted, pull
        the global state, take part in the round it was admitted at with nothing of
        its own. Returns the inner step to train on from."""
        raise NotImplementedError

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

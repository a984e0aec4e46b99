"""Every strategy's state_dict round-trips, and training goes on from it bit for bit.

In one process, without a network: the job has one site, whose exchange is the
identity (the average over one site is its own values), so the strategies run
their real hooks, rounds, outer steps and exchanges in flight. What crosses a
real WAN is tests/test_resume.py's (every strategy, separate processes).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from isthmus.inter.hierarchical import StepReport
from isthmus.inter.membership import View
from isthmus.inter.strategies import AsyncDiLoCo, DiLoCo, Strategy, StreamingDiLoCo, Sync
from isthmus.job.layout import Layout

REPORT = StepReport(0.0, 0.0, 0.0, wan_values=0, wan_bytes_sent=3, wan_bytes_received=5)


class _Exchanged:
    """A finished exchange over one site: the tensors keep their values."""

    def wait(self, abort: Callable[[], bool] | None = None) -> StepReport:
        return REPORT

    def discard(self) -> None:
        pass


class OneSite:
    """A one-site, one-rank stand-in for :class:`SiteRuntime`: its round counter and
    a stand-in error-feedback state, which a checkpoint carries."""

    name = "a"
    membership = None

    def __init__(self) -> None:
        self.layout = Layout.for_ranks(1)
        self.job = SimpleNamespace(sites=[SimpleNamespace(name="a", layout=self.layout)])
        self.step = self
        self._round = -1

    def next_round(self) -> int:
        self._round += 1
        return self._round

    def set_codec(self, codec: object) -> None:
        pass

    def start(self, tensors: list[torch.Tensor], **_: Any) -> _Exchanged:
        return _Exchanged()

    def average(self, tensors: list[torch.Tensor], **_: Any) -> StepReport:
        return REPORT

    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        return {"round": self._round, "feedback": {0: {"model": torch.full((2,), self._round)}}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._round = int(state["round"])


class Blocks(nn.Module):
    """Two numbered blocks (Streaming DiLoCo cuts fragments along them)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


STRATEGIES: dict[str, Callable[..., Strategy]] = {
    "sync": lambda site, m, o: Sync(site, m, o, bucket_mb=1e-4),
    "sync-after-backward": lambda site, m, o: Sync(site, m, o, overlap=False),
    "diloco": lambda site, m, o: DiLoCo(site, m, o, sync_every=3),
    "streaming": lambda site, m, o: StreamingDiLoCo(
        site, m, o, sync_every=4, fragments=2, overlap_steps=1, alpha=0.5
    ),
    "async": lambda site, m, o: AsyncDiLoCo(site, m, o, sync_every=3),
}


def _build(name: str) -> tuple[Strategy, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    return STRATEGIES[name](OneSite(), model, optimizer), model, optimizer


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def _assert_same(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {a.keys()} != {b.keys()}"
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("steps", [5, 6])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_strategy_state_round_trips_and_training_goes_on_identically(name, steps):
    """Async has an exchange in flight at both points, Streaming at 6 only (the
    fragment started at step 4 completed at 5); DiLoCo is one step into a round at
    5 and between rounds at 6."""
    strategy, model, optimizer = _build(name)
    _train(model, optimizer, range(steps))
    assert strategy.inner_steps == steps
    if name.startswith("sync"):
        assert strategy.outer_steps == steps
        # What a membership would have counted (every step a round): Sync's
        # state_dict once left it out, though its load_state_dict read it.
        strategy.member.rounds = steps
    strategy.member.epoch = 1  # the view entered, as a membership would set it
    state = strategy.state_dict()
    assert state["member"] == {"rounds": strategy.member.rounds, "epoch": 1}
    in_flight = name == "async" or (name == "streaming" and steps == 6)
    assert ("in_flight" in state) == in_flight

    # Copies, as a checkpoint on disk would give (loading an optimizer's state keeps
    # its tensors: the two runs would share momentum buffers).
    fresh, fresh_model, fresh_optimizer = _build(name)
    fresh.load_state_dict(copy.deepcopy(state))
    fresh_model.load_state_dict(copy.deepcopy(model.state_dict()))
    fresh_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    _assert_same(state, fresh.state_dict())
    if name == "diloco":
        # What a site catching up would pull from each: a resumed donor once gave
        # step 0 until it completed a round of its own.
        _assert_same(strategy._global_state(), fresh._global_state())

    _train(model, optimizer, range(steps, 12))
    _train(fresh_model, fresh_optimizer, range(steps, 12))
    strategy.finish()
    fresh.finish()
    _assert_same(strategy.state_dict(), fresh.state_dict())
    for mine, theirs in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("name", ["sync", "diloco"])
def test_a_checkpoint_from_before_the_rounds_were_held_apart_still_loads(name):
    """Checkpoints written before kept DiLoCo's rounds and epoch at the top level
    and Sync's not at all (its rounds were its outer steps)."""
    strategy, model, optimizer = _build(name)
    _train(model, optimizer, range(6))
    strategy.member.rounds, strategy.member.epoch = 2, 1
    state = strategy.state_dict()
    old = {k: v for k, v in state.items() if k != "member"}
    if name == "diloco":
        old.update(rounds=2, epoch=1)
    fresh, _, _ = _build(name)
    fresh.load_state_dict(old)
    expected = {"rounds": 2, "epoch": 1} if name == "diloco" else {"rounds": 6, "epoch": 0}
    assert fresh.member.state_dict() == expected


def test_a_diloco_site_that_caught_up_gives_the_next_puller_the_others_step():
    """Site a pulls b's state after 4 rounds (12 steps) and takes part in round 4 with
    nothing; from then on a is at step 15 like b, and a site that pulls a's state
    after 5 rounds gets step 15 too. a once served the step it pulled (12): its
    round's steps were counted after the round, outside the lock, and the site that
    caught up from it trained a round behind everyone and waited for an extra round
    alone at the end (the CI failure of test_site_loss's DiLoCo case)."""
    donor, donor_model, donor_optimizer = _build("diloco")  # sync_every=3
    _train(donor_model, donor_optimizer, range(12))
    assert (donor.member.rounds, donor._global_state()["inner_steps"]) == (4, 12)
    pulled = copy.deepcopy({"rounds": 4, **donor._global_state()})

    strategy, _, _ = _build("diloco")
    member = strategy.member
    view = View(epoch=1, members=("a",), start_round=4, engine_round=8, catch_up=("a",), donor="b")

    def caught_up_round(attempt: Callable[[View, bool], None], **_: Any) -> bool:
        # What MemberRounds does for a view that names this site in catch_up.
        with member.lock:
            strategy._load_global_state(pulled, "b")
            member.rounds = pulled["rounds"]
        attempt(view, True)
        return True

    member.membership = SimpleNamespace(newer_view=lambda rounds: None)
    member.as_member = caught_up_round
    member.report_done = lambda: None
    strategy.sync()
    assert member.rounds == 5
    assert strategy.inner_steps == 15
    assert strategy._global_state()["inner_steps"] == 15


class RecordingSite(OneSite):
    """:class:`OneSite` that records when each average starts and is waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.data_rounds: list[dict[str, Any]] = []

    def start(self, tensors: list[torch.Tensor], **kwargs: Any) -> Any:
        what = "vote" if kwargs.get("exact") else "data"
        self.calls.append(f"start {what}")
        if what == "data":
            self.data_rounds.append(kwargs)
        calls = self.calls

        class Pending:
            def wait(self, abort: Callable[[], bool] | None = None) -> StepReport:
                calls.append(f"wait {what}")
                return REPORT

            def discard(self) -> None:
                calls.append(f"discard {what}")

        return Pending()


def test_diloco_sends_its_data_beside_the_vote_once_the_sites_share_a_scale():
    """A round's vote and its data each take a round trip of the longest link: the
    first round votes before its data leave (the sites share no scale yet), every
    later one sends both at once and waits for the vote while the data travel."""
    torch.manual_seed(0)
    model = Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    site = RecordingSite()
    diloco = DiLoCo(site, model, optimizer, sync_every=2)
    _train(model, optimizer, range(4))
    assert site.calls == [
        *("start vote", "wait vote", "start data", "wait data"),
        *("start vote", "start data", "wait vote", "wait data"),
    ]
    assert diloco.outer_steps == 2
    assert diloco.last_seal.scale_tokens == {"a": 2}
    # The first round's data weighted by the seal; the second's at weight 1, each
    # site's values scaled by its tokens over the scale (2 over 2), and, as every
    # DiLoCo exchange, nothing averaged inside the site (its ranks hold one model).
    first, second = site.data_rounds
    assert first["weights"] == {"a": 2.0} and first.get("scale", 1.0) == 1.0
    assert second["weights"] == {"a": 1.0} and second["scale"] == 1.0
    assert not first.get("in_site_reduce", False) and second["in_site_reduce"] is False


class OutOfStepSite(OneSite):
    """:class:`OneSite` whose vote comes back with a scale, as if the other sites had
    sent the round's data beside it while this one holds none."""

    def start(self, tensors: list[torch.Tensor], **kwargs: Any) -> _Exchanged:
        if kwargs.get("exact"):
            tensors[0][6] = 5.0  # the first digit of the scale (inter/commit.py)
        return _Exchanged()


def test_a_site_without_the_scale_the_others_sent_at_stops_with_one_line():
    """Averaging apart would part the models silently; the site says why instead."""
    torch.manual_seed(0)
    model = Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    DiLoCo(OutOfStepSite(), model, optimizer, sync_every=2)
    with pytest.raises(RuntimeError, match=r"data beside the vote \(scales \{'a': 5\}\)"):
        _train(model, optimizer, range(2))

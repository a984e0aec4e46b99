"""A run's site on the control plane: status, telemetry, and live settings applied in step.

Rank 0 of the site holds the MQTT client (:class:`isthmus.inter.control_plane.ControlPlane`);
at each outer round it takes the settings due from that round and hands them
to the site's other ranks over the site's own process group, so every rank of
every site changes at the same round. Nothing here waits on the broker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from isthmus.inter import newcomers
from isthmus.inter.control_plane import Broker, ControlPlane
from isthmus.inter.membership import Membership
from isthmus.inter.strategies import Strategy, StreamingDiLoCo, Sync
from isthmus.intra import collectives
from isthmus.intra.devices import compute_device
from isthmus.job.file import Job
from isthmus.job.settings import TrainSettings

log = logging.getLogger("isthmus.control")

STATUS_EVERY_S = 1.0
"""Between status updates in the middle of a round (each round's end always sends one)."""


EMBEDDED_WAIT_S = 10.0


def run_broker(job: Job, run_dir: Path, site: str) -> tuple[Broker, float] | None:
    """The broker a run's sites use (the job file's, else the launcher's embedded
    one) and how long to wait for it at start."""
    if job.control is not None:
        return job.control.broker_for(site), job.control.wait_s
    state = run_dir / "control.json"
    if not state.exists():
        return None
    return Broker.from_url(json.loads(state.read_text())["broker"]), EMBEDDED_WAIT_S


def membership_for(job: Job, run_dir: Path, site: str, *, rejoining: bool) -> Membership | None:
    """The site's side of the membership protocol, where the run can lose and regain
    sites: two sites or more, and a control plane to carry it."""
    if not job.survives_site_loss or run_broker(job, run_dir, site) is None:
        return None
    names = [s.name for s in job.sites]
    return Membership(
        names,
        site,
        min_sites=job.train.quorum(len(names)),
        joining=rejoining,
        # Waiting longer for the members' reports than a round's deadline is never
        # needed: by then every member still in the round has failed it or completed it.
        stuck_settle_s=job.train.round_deadline_s,
    )


class SiteControl:
    """The control plane as one rank of a site sees it (only rank 0 connects)."""

    def __init__(
        self,
        job: Job,
        run_dir: Path,
        site: str,
        rank: int,
        ranks: int,
        address: str,
        membership: Membership | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """``address``: where the site's rank 0 serves its peers (host:port).
        ``membership``: the site's side of the membership protocol, which the
        control plane carries. ``device``: where this rank computes (default:
        ``train.device`` resolved), which the settings' broadcast stages on."""
        self.ranks = ranks
        self.device = compute_device(job.train.device) if device is None else torch.device(device)
        self.plane: ControlPlane | None = None
        self.observer: ControlPlane | None = None
        """The other ranks' read-only client: each rank follows the membership views
        itself, since a rank waiting on a round cannot hear from rank 0."""
        self._last_status = 0.0
        broker = run_broker(job, run_dir, site)
        if broker is not None and rank != 0 and membership is not None:
            self.observer = ControlPlane(
                broker[0], job.name, None, settings=job.train, membership=membership
            ).start()
        if broker is not None and rank == 0:
            broker_address, wait_s = broker
            status = {"ranks": ranks, "step": 0, "round": 0, "address": address}
            spec = job.site(site)
            # What sites running an older job file need to take this one in.
            description = newcomers.describe(spec.layout, spec.dial_addresses())
            if description is not None:
                status["spec"] = description

            def client() -> ControlPlane:
                return ControlPlane(
                    broker_address,
                    job.name,
                    site,
                    settings=job.train,
                    status=status,
                    membership=membership,
                )

            self.plane = client()
            try:
                self.plane.start(wait_s=wait_s)
            except ConnectionError as exc:
                if job.control is not None:
                    raise  # the job names a broker: say it is not there
                # The embedded one is late: the run goes on and the client keeps
                # retrying in the background (a site lost meanwhile holds the
                # others at the round's deadline until it connects).
                log.warning("%s", exc)
                self.plane = client().start()

    def step(self, step: int, outer_round: int) -> None:
        if self.plane is not None and time.monotonic() - self._last_status >= STATUS_EVERY_S:
            self._last_status = time.monotonic()
            self.plane.update_status(step=step, round=outer_round)

    def round_ended(self, outer_round: int, step: int, **metrics: Any) -> dict[str, Any]:
        """Report the round; return the settings every rank applies from now on."""
        changes: dict[str, Any] = {}
        if self.plane is not None:
            self._last_status = time.monotonic()
            self.plane.update_status(step=step, round=outer_round)
            self.plane.publish_metrics(round=outer_round, step=step, **metrics)
            changes = self.plane.changes_due(outer_round)
        if self.ranks > 1:
            shared = [changes]
            collectives.broadcast_object_list(
                shared, src=0, device=self.device, where="control.live_settings"
            )
            changes = shared[0]
        return changes

    def close(self, done: bool) -> None:
        """``done``: this site trained to its end (or left); a site that failed or
        was stopped goes offline only, as one that died would, and may come back."""
        if self.observer is not None:
            self.observer.close()
        if self.plane is not None:
            if done and self.plane.membership is not None:
                # Gone on purpose: the others must not wait for it, nor take it for lost.
                self.plane.membership.report(phase="done")
            self.plane.close()


def apply_settings(
    changes: dict[str, Any],
    settings: TrainSettings,
    strategy: Strategy,
    site: str,
    *,
    builtin_loop: bool,
) -> tuple[TrainSettings, dict[str, Any]]:
    """Apply live settings to the strategy (what it has of them); return the run's
    settings with them and the changes that applied. A setting that cannot take
    effect here is logged and skipped, the same way on every site: ``sync_every``
    under a strategy that fixes it at the start, an outer setting under ``sync``,
    ``inner_lr`` under a script (its optimizer is its own)."""
    applicable = dict(changes)

    def skip(name: str, why: str) -> None:
        if applicable.pop(name, None) is not None:
            log.warning("site %s: %s not changed: %s", site, name, why)

    if isinstance(strategy, Sync | StreamingDiLoCo):
        skip("sync_every", f"{type(strategy).__name__} fixes it at the start")
    outer = getattr(strategy, "outer", None)
    if outer is None:
        for name in ("outer_lr", "outer_momentum"):
            skip(name, f"{type(strategy).__name__} has no outer step")
    if not builtin_loop:
        skip("inner_lr", "the script's optimizer sets its own learning rate")
    if "sync_every" in applicable:
        strategy.sync_every = applicable["sync_every"]  # type: ignore[attr-defined]
    if "codec" in applicable:
        strategy.codec = applicable["codec"]
    if outer is not None:
        if "outer_lr" in applicable:
            outer.lr = applicable["outer_lr"]
        if "outer_momentum" in applicable:
            for group in outer.optimizer.param_groups:
                group["momentum"] = applicable["outer_momentum"]
                group["nesterov"] = applicable["outer_momentum"] > 0
    if applicable:
        log.warning("site %s: live settings applied: %s", site, applicable)
    return dataclasses.replace(settings, **applicable), applicable

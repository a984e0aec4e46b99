"""Every rank's ``/metrics`` for Prometheus, read live from the rank at each scrape.

With ``metrics: {prometheus_port: PORT}`` in the job file, each rank serves
the Prometheus text format over HTTP (prometheus_client's server, on its own
thread): on a real cluster on PORT + its local rank, under ``isthmus run`` on
the free port the launcher gives it (``ISTHMUS_METRICS_PORTS``, one per rank,
listed in the run directory's ``endpoints.json``).

The collector reads the rank's own counters when scraped, so nothing is pushed
from the training loop and a scrape costs the loop nothing: steps, rounds,
loss, tokens and the last round's timings come from the site's
:class:`~isthmus.training.builtin_loop.TrainingRun`, the WAN bytes from this
rank's peer endpoint (what the round records and ``summary.json`` sum over
ranks), the view from the membership. Every series carries ``site`` and
``rank``; summed over ranks and sites, ``isthmus_wan_bytes_sent_total`` is the
run's ``wan_bytes``. A rank writes its last scrape to
``sites/SITE/metrics-rank-R.prom`` as it exits (the final values, which no
scrape can fetch once the process is gone).
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isthmus.intra.process_group import SiteError
from isthmus.training.environment import METRICS_PORTS

if TYPE_CHECKING:
    from isthmus.job.model import Job
    from isthmus.training.site import Site


class SiteCollector:
    """The ``isthmus_*`` metrics of one rank (a prometheus_client custom collector)."""

    def __init__(self) -> None:
        self.site: Site | None = None
        """Set once the rank has joined; until then a scrape is empty."""

    def describe(self) -> list[Any]:
        return []  # not described ahead: the peers' labels are known only when scraped

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        site = self.site
        if site is None:
            return
        runtime = site.runtime
        labels = ["site", "rank"]
        me = [site.name, str(site.rank)]
        run = site.run
        strategy = run.strategy if run is not None else None

        def counter(name: str, doc: str, value: float) -> Any:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(me, value)
            return family

        def gauge(name: str, doc: str, value: float) -> Any:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(me, value)
            return family

        yield counter(
            "isthmus_inner_steps", "Inner steps this site completed", run.steps_done if run else 0
        )
        yield counter(
            "isthmus_outer_rounds",
            "Rounds across sites completed (outer steps)",
            strategy.outer_steps if strategy is not None else 0,
        )
        yield counter(
            "isthmus_tokens",
            "Tokens this site trained (all its replicas)",
            run.tokens if run else 0,
        )
        loss = run.loss if run is not None and run.loss is not None else math.nan
        yield gauge("isthmus_loss", "Training loss of the last step (site mean)", loss)
        last = run.last_round if run is not None else {}
        yield gauge(
            "isthmus_tokens_per_second",
            "Tokens per second over the last round",
            last.get("tokens_per_s") or 0.0,
        )
        yield gauge(
            "isthmus_round_seconds", "Wall time of the last round", last.get("round_s", 0.0)
        )
        yield counter(
            "isthmus_waiting_seconds",
            "Time the loop waited on other sites (membership, stragglers)",
            run.waiting_s if run is not None else 0.0,
        )
        sent = CounterMetricFamily(
            "isthmus_wan_bytes_sent",
            "Payload bytes this rank sent to each peer site",
            labels=[*labels, "peer_site"],
        )
        for peer, value in sorted(runtime.endpoint.bytes_sent_to().items()):
            sent.add_metric([*me, peer], value)
        yield sent
        received = CounterMetricFamily(
            "isthmus_wan_bytes_received",
            "Payload bytes this rank received from each peer site",
            labels=[*labels, "peer_site"],
        )
        for peer, value in sorted(runtime.endpoint.bytes_received_from().items()):
            received.add_metric([*me, peer], value)
        yield received
        refused = CounterMetricFamily(
            "isthmus_peer_refusals",
            "Calls, streams and chunks this rank's peer service refused, by kind "
            "(WRONG_JOB, STALE_ROUND, TOO_MANY_STREAMS, TOO_LARGE, REVOKED, ...)",
            labels=[*labels, "kind"],
        )
        for kind, value in sorted(site.refusals.items()):
            refused.add_metric([*me, kind], value)
        yield refused
        membership = runtime.membership
        if membership is not None:
            yield counter(
                "isthmus_stale_views",
                "Membership views refused as older than the one in force (replays)",
                membership.stale_views,
            )
            view = membership.applied
            yield gauge("isthmus_membership_epoch", "The membership view in force", view.epoch)
            yield gauge(
                "isthmus_membership_members", "Sites in the view in force", len(view.members)
            )
        settings = run.settings if run is not None else site.job.train
        info = GaugeMetricFamily(
            "isthmus_settings",
            "The settings in force (value 1): strategy, codec, and what trains (the model "
            "and inner optimizer: the built-in loop's or the script's own)",
            labels=[*labels, "strategy", "codec", "model", "inner_optimizer"],
        )
        codec = getattr(strategy, "codec", None)
        model = site.described.get("model") or (type(run.model).__name__ if run else "")
        optimizer = type(run.optimizer).__name__ if run is not None else ""
        info.add_metric(
            [
                *me,
                settings.strategy,
                getattr(codec, "name", None) or str(settings.codec),
                str(model),
                optimizer,
            ],
            1,
        )
        yield info
        yield gauge("isthmus_sync_every", "Inner steps per round (H)", settings.sync_every)


class MetricsEndpoint:
    """A rank's ``/metrics`` server, and its last scrape written at close."""

    def __init__(self, site: str, rank: int, port: int, host: str) -> None:
        """Serve now (a port in use is refused before the rank joins and the other
        sites wait on it); the figures follow once :meth:`attach` gives the site."""
        from prometheus_client import CollectorRegistry, start_http_server

        self.collector = SiteCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.port = port
        try:
            self._server, self._thread = start_http_server(port, host, registry=self.registry)
        except OSError as exc:
            taken = exc.errno == errno.EADDRINUSE
            raise SiteError(
                f"metrics.prometheus_port: rank {rank} of site {site} cannot serve "
                f"/metrics on {host}:{port} "
                f"({'in use' if taken else exc.strerror}); give the job another port "
                "(rank r of a node uses port + r)"
            ) from None

    def attach(self, site: Site) -> None:
        self.collector.site = site

    def scrape(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def close(self, final: Path | None) -> None:
        """Write the last scrape to ``final`` (if given) and stop serving."""
        if final is not None:
            final.parent.mkdir(parents=True, exist_ok=True)
            temporary = final.with_name(f".{final.name}.{os.getpid()}")
            temporary.write_bytes(self.scrape())
            temporary.replace(final)
        self._server.shutdown()
        self._server.server_close()


def metrics_port(job: Job, rank: int) -> tuple[int, str] | None:
    """Where rank ``rank`` serves ``/metrics``: ``(port, host)``, or None when the job
    names no ``metrics:``. ``isthmus run``'s free ports first, then the job's port
    plus the rank's local rank (torchrun's ``LOCAL_RANK``) on every interface."""
    spec = job.metrics
    if spec is None:
        return None
    given = os.environ.get(METRICS_PORTS)
    if given:
        ports = [int(p) for p in given.split(",")]
        return ports[rank], "127.0.0.1"
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return spec.prometheus_port + local_rank, "0.0.0.0"

"""A job started afresh forgets what an earlier run of it left at the broker.

The control plane keeps a job's membership view, its live settings and every
site's status as retained messages under ``isthmus/<job>/``, so that a site
that connects late learns the state of the run it joins. When a run ends
without a clean end (a site killed, the job stopped), those messages stay, and
the next run of the same job on the same broker would read them as its own:
every site would take the old run's view (its members and round numbers, e.g.
"members a, b from round 5" while the new run is at round 0), its live
settings, and its sites' "offline" statuses. The sites of the new run then
ran rounds under that view and never met (measured: a three-site rerun after
a run that had left one site out ended with every site failing).

So a site that starts afresh (not ``--rejoin``, not ``--resume``, which agree
on their own) looks first, with a short-lived client of its own, before its
control plane subscribes: if no site of the job is online, no run of it is
live, and it clears the job's retained view, live settings and statuses. If
a site is online, a run is live (or another site of the new run has already
cleared them and gone online: it clears before its own control plane says
"online"), and nothing is touched: the site joins that run as a late starter.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from isthmus.inter.control_topics import config_topic, decode, membership_topic, site_of
from isthmus.job.file import Job

log = logging.getLogger(__name__)

QUIET_S = 0.5
"""Retained messages come right after the subscription: once none has come for this
long, the broker has sent them all."""
READ_AT_MOST_S = 5.0


def forget_stale_run(job: Job, site: str | None) -> list[str]:
    """Clear what an earlier run of ``job`` left at its broker, unless a site of the
    job is online; returns the topics cleared (none: no broker, a live run, or
    nothing left). ``site``: whose broker address to use (None: the job's)."""
    if job.control is None:
        return []  # the embedded broker is new with every run
    try:
        return asyncio.run(_forget(job, site))
    except Exception as exc:  # the site's own control plane says it, with the fix
        log.debug("could not look for an earlier run of job %s at the broker: %s", job.name, exc)
        return []


async def _forget(job: Job, site: str | None) -> list[str]:
    assert job.control is not None
    broker = job.control.broker_for(site)
    statuses: dict[str, dict] = {}
    retained: dict[str, None] = {}  # the topics, in the order they came, once each
    identifier = f"isthmus-fresh-start-{job.name}-{site or 'run'}-{secrets.token_hex(4)}"
    async with broker.client(identifier, timeout=5) as client:
        await client.subscribe(f"isthmus/{job.name}/sites/+/status", qos=1)
        await client.subscribe(membership_topic(job.name), qos=1)
        await client.subscribe(config_topic(job.name), qos=1)
        messages = client.messages.__aiter__()
        started = time.monotonic()
        while time.monotonic() - started < READ_AT_MOST_S:
            try:
                message = await asyncio.wait_for(messages.__anext__(), timeout=QUIET_S)
            except TimeoutError:
                break
            if not message.payload:
                continue  # cleared already
            topic = str(message.topic)
            retained[topic] = None
            if (kind := site_of(topic, job.name)) is not None:
                body = decode(message.payload)
                statuses[kind[1]] = body if isinstance(body, dict) else {}
        online = sorted(s for s, body in statuses.items() if body.get("state") == "online")
        if online:
            log.info(
                "a run of job %s is live (online: %s): joining it as it is",
                job.name,
                ", ".join(online),
            )
            return []
        for topic in retained:
            await client.publish(topic, b"", qos=1, retain=True)
    if retained:
        log.info(
            "cleared what an earlier run of job %s left at the broker (%s): no site of it "
            "is online, so this one starts afresh",
            job.name,
            ", ".join(retained),
        )
    return list(retained)

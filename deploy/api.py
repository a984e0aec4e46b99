"""``isthmus.join``: the one call a training script makes to take part in a job.

Glue, so it lives in ``deploy``: joining by a job file's path means reading the
YAML and validating it, which needs every layer's names (model sizes, link
presets); the joining itself (:func:`isthmus.inter.join.start_site`) needs only
the job model. ``isthmus.join`` re-exports it lazily.
"""

from __future__ import annotations

from pathlib import Path

from isthmus.deploy.jobfile import Job, load_job
from isthmus.inter.codecs import parse_codec
from isthmus.inter.join import SiteRuntime, start_site
from isthmus.job.addressing import default_state_path, load_state


def join(
    job: str | Path | Job,
    site: str,
    *,
    state: str | Path | None = None,
    codec: str = "none",
    deadline_s: float = 120.0,
) -> SiteRuntime:
    """Join ``site`` of ``job`` on this rank: read the job file, start this rank's
    peer service, connect to the counterparts in the other sites.

    Addresses: the emulator's state file ``state`` when given; else, when the job
    has a ``wan:`` section and ``<job name>.wan.json`` (what ``isthmus wan up``
    writes) exists, that; else the sites' own ``address`` fields (a real network).
    Under torchrun, every rank of the site calls it.
    """
    job = job if isinstance(job, Job) else load_job(job)
    if state is None and job.wan is not None and default_state_path(job).exists():
        state = default_state_path(job)
    return start_site(
        job,
        site,
        state=load_state(state) if state is not None else None,
        codec=parse_codec(codec),
        deadline_s=deadline_s,
    )

"""The link model moved to :mod:`isthmus.job.link` (the job model, below every layer);
this name stays for code written against it."""

from isthmus.job.link import (  # noqa: F401
    DEFAULT_MSS_BYTES,
    DEFAULT_WINDOW_BYTES,
    DIRECTION_FIELDS,
    JITTER_DISTRIBUTIONS,
    LINK_FIELDS,
    LINUX_MIN_RTO_MS,
    DirectionParams,
    LinkConfigError,
    LinkParams,
    direction_params,
    link_changes_to_direction,
)

"""The site layout moved to :mod:`isthmus.job.layout` (the job model, below every
layer); this name stays for code written against it."""

from isthmus.job.layout import (  # noqa: F401
    DIMENSIONS,
    Layout,
    LayoutError,
    check_sites,
    stage_layers,
)

"""``isthmus.join``: the one call a training script makes to take part in a job.

Glue, so it lives in ``deploy``: joining by a job file's path means reading the
YAML and validating it, which needs every layer's names (model sizes, link
presets); the joining itself (:func:`isthmus.inter.join.start_site`) needs only
the job model. ``isthmus.join`` re-exports it lazily; the handle it returns and
the run it drives are :mod:`isthmus.deploy.session`.
"""

from __future__ import annotations

from isthmus.deploy.session.site import Site, join

__all__ = ["Site", "join"]

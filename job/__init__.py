"""The job model: what a multi-site job is, as plain data, below every layer.

Every layer reads a job (``intra`` its layout, ``inter`` the sites and settings,
``sim`` the links and faults, ``deploy`` all of it), so its description sits
below them all and imports none of them: no torch, no gRPC, no YAML. Loading
a job file and validating it with line numbers needs every layer's names
(model sizes, link presets) and lives above, in ``isthmus.job.file``.

* :mod:`~isthmus.job.basics`: the error base, the number check and the codec
  names that every layer's own checks share;
* :mod:`~isthmus.job.model`: the job, its sites, links, control plane and TLS;
* :mod:`~isthmus.job.settings`, :mod:`~isthmus.job.tune`, :mod:`~isthmus.job.link`,
  :mod:`~isthmus.job.fault_schedule`, :mod:`~isthmus.job.layout`,
  :mod:`~isthmus.job.broker`: the sections' own settings, each validated once;
* :mod:`~isthmus.job.ports`: picking free ports to listen on.
"""

"""The training layer: what runs inside a rank, whoever launched it.

Above ``inter`` (across sites) and below ``deploy`` (launchers, command line):
a user's script and Isthmus's own loop import this, and nothing here imports a
launcher. The parts:

- :mod:`site`: ``isthmus.join()`` and the :class:`~isthmus.training.site.Site`
  handle a script holds (``site.strategy``, ``site.steps``, ``site.log``);
- :mod:`builtin_loop`: the run a ``site.strategy(...)`` block drives
  (membership, live settings, checkpoints, records, the result);
- :mod:`strategy_choice`: the job's settings made into a strategy;
- :mod:`environment`: the contract between the launchers (``isthmus run``,
  ``isthmus site``) and the process they start;
- :mod:`worker` and :mod:`rank_setup`: Isthmus's own training loop, one user of
  the API above;
- :mod:`site_control`: the site on the control plane (status, telemetry, live
  settings applied in step);
- :mod:`records`, :mod:`round_records`, :mod:`prometheus`: what a rank writes
  and exposes; :mod:`orphan`: a rank's exit when its launcher is gone;
  :mod:`site_errors` and :mod:`log_format`: one-line errors and log lines.
"""

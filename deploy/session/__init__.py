"""A training script's side of a job: ``isthmus.join()`` and what it returns.

:mod:`environment` is the contract between the launchers (``isthmus run``,
``isthmus site``) and the script they start; :mod:`site` is the object a script
holds (:class:`~isthmus.deploy.session.site.Site`); :mod:`training` the run
its ``site.strategy(...)`` block drives: membership, live settings,
checkpoints, records and the result.
"""

"""Isthmus: train one PyTorch model across geographically separate clusters.

This top-level package only re-exports the public face; the code lives in the
sub-packages ``isthmus.job`` (the job model, below every layer),
``isthmus.intra`` (one site), ``isthmus.inter`` (across sites), ``isthmus.proto``
(wire schema), ``isthmus.sim`` (WAN emulator and performance model) and
``isthmus.deploy`` (job files, command line, launcher, ``isthmus.join``).

The training API (the user keeps their own loop)::

    site = isthmus.join("job.yaml", site="us-east")
    with isthmus.DiLoCo(site, model, inner_optimizer, sync_every=100) as diloco:
        for x, y in loader:
            ...
            inner_optimizer.step()   # every sync_every steps the round runs here

Its names load on first use, so ``import isthmus`` (and the command line) does
not pay for torch and gRPC.
"""

from typing import Any

from isthmus._version import __version__

_LAZY = {
    "join": "isthmus.training.site",
    "Sync": "isthmus.inter.strategies",
    "DiLoCo": "isthmus.inter.strategies",
    "StreamingDiLoCo": "isthmus.inter.strategies",
    "AsyncDiLoCo": "isthmus.inter.strategies",
    "SiteAdamW": "isthmus.intra.site_adamw",
}

__all__ = [
    "AsyncDiLoCo",
    "DiLoCo",
    "SiteAdamW",
    "StreamingDiLoCo",
    "Sync",
    "__version__",
    "join",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'isthmus' has no attribute {name!r}")

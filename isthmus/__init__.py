"""Isthmus: train one PyTorch model across geographically separate clusters.

This top-level package only re-exports the public face; the code lives in the
sub-packages ``isthmus.intra`` (one site), ``isthmus.inter`` (across sites),
``isthmus.proto`` (wire schema), ``isthmus.sim`` (WAN emulator and performance
model) and ``isthmus.deploy`` (job files, command line, launcher).
"""

from isthmus._version import __version__

__all__ = ["__version__"]

"""The version of Isthmus, single-sourced for pyproject and `isthmus --version`."""

__version__ = "0.1.0"

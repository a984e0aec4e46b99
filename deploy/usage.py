"""How a subcommand joins the command line, and the error that means bad input.

Command modules import this, never the command line's own module, so the
command line can import them all without a cycle; it is light (argparse only)
because ``isthmus --help`` imports every command module.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error that points at --help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


Command = Callable[[argparse.Namespace], int]


def add_command(
    commands: Any, name: str, handler: Command, *, help: str, description: str | None = None
) -> argparse.ArgumentParser:
    """Register a subcommand whose arguments the caller adds to the returned parser."""
    sub: argparse.ArgumentParser = commands.add_parser(
        name, help=help, description=description or help
    )
    sub.set_defaults(handler=handler, prog=sub.prog)
    return sub

"""How a subcommand joins the command line, and the error that means bad input.

Command modules import this, never the command line's own module, so the
command line can import them all without a cycle; it is light (argparse only)
because ``isthmus --help`` imports every command module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error that points at --help."""

    def error(self, message: str) -> NoReturn:
        hint = self._nested_hint(message)
        self.exit(2, f"{self.prog}: error: {message}{hint} (see '{self.prog} --help')\n")

    def _nested_hint(self, message: str) -> str:
        """For ``invalid choice: 'render'``: the command one level down that has that
        name (``isthmus deploy render``), or the nearest spelling."""
        import difflib
        import re

        found = re.search(r"invalid choice: '([^']+)'", message)
        if not found:
            return ""
        wanted = found.group(1)
        commands = argparse._SubParsersAction
        nested, names = [], []
        for action in self._actions:
            if isinstance(action, commands):
                for name, sub in action.choices.items():
                    names.append(name)
                    nested += [
                        f"{self.prog} {name} {wanted}"
                        for inner in sub._actions
                        if isinstance(inner, commands) and wanted in inner.choices
                    ]
        if nested:
            return f"; did you mean '{nested[0]}'?"
        close = difflib.get_close_matches(wanted, names, n=1)
        return f"; did you mean '{self.prog} {close[0]}'?" if close else ""


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


def accept_command(parser: argparse.ArgumentParser) -> None:
    """Everything after the first ``--`` is a command to run, left whole in
    ``args.command`` (None without ``--``).

    argparse alone cannot do it: a ``nargs="*"`` positional after an optional
    one is filled (empty) at the first positional, and it drops every ``--`` of
    the command itself. The subcommand's parser is called with its own
    arguments, so it splits them before it parses them.
    """
    parse = parser.parse_known_args

    def parse_known_args(
        args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        given = list(sys.argv[1:] if args is None else args)
        command = None
        if "--" in given:
            split = given.index("--")
            given, command = given[:split], given[split + 1 :]
        namespace, extras = parse(given, namespace)
        namespace.command = command
        return namespace, extras

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]

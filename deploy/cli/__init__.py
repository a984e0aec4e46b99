"""The ``isthmus`` command line: subcommands, one-line usage errors, exit codes.

Exit codes: 0 success; 1 a failure while running; 2 bad input (flags, job
file, an address that cannot be used), always with a message that names the
flag or field and the fix. No command ends in a traceback for bad input.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from isthmus._version import __version__


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error that points at --help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


Command = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="isthmus",
        description="Train one PyTorch model across far-apart clusters; "
        "emulate the WAN between them.",
    )
    parser.add_argument("--version", action="version", version=f"isthmus {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more detail")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    from isthmus.deploy.cli import (
        bench,
        control,
        job,
        render,
        run,
        sim,
        site,
        tune,
        wan,
    )
    from isthmus.deploy.render import certs

    run.register(commands)
    site.register(commands)
    control.register(commands)
    sim.register(commands)
    tune.register(commands)
    job.register(commands)
    wan.register(commands)
    bench.register(commands)
    certs.register(commands)
    render.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="isthmus: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    handler: Command = args.handler
    from isthmus.job.addressing import AddressError

    try:
        return handler(args)
    except (UsageError, AddressError) as exc:
        print(f"{args.prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a known kind of bad input may surface from deep inside
        from isthmus.deploy.jobfile import JobFileError

        if isinstance(exc, JobFileError):
            for line in exc.lines():
                print(f"error: {line}", file=sys.stderr)
            return 2
        raise


def add_command(
    commands: Any, name: str, handler: Command, *, help: str, description: str | None = None
) -> argparse.ArgumentParser:
    """Register a subcommand whose arguments the caller adds to the returned parser."""
    sub: argparse.ArgumentParser = commands.add_parser(
        name, help=help, description=description or help
    )
    sub.set_defaults(handler=handler, prog=sub.prog)
    return sub

"""The ``isthmus`` command line: subcommands, one-line usage errors, exit codes.

Each subcommand lives in a module of this package (``run``, ``site``, ``wan``, ...)
that registers itself through :mod:`~isthmus.deploy.usage` and imports
what it runs (torch, gRPC, the launcher) inside its handlers: ``isthmus --help``
and every ``--help`` below it load neither torch nor gRPC.

Exit codes: 0 success; 1 a failure while running; 2 bad input (flags, job
file, an address that cannot be used), always with a message that names the
flag or field and the fix. No command ends in a traceback for bad input.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from isthmus._version import __version__
from isthmus.deploy.usage import Command, Parser, UsageError, add_command
from isthmus.training.log_format import say


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="isthmus",
        description="Train one PyTorch model across far-apart clusters; "
        "emulate the WAN between them.",
    )
    parser.add_argument("--version", action="version", version=f"isthmus {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more detail")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    commands.required = True

    from isthmus.deploy.cli import (
        bench,
        certs,
        config_watch,
        job,
        render,
        run,
        sim,
        site,
        tune,
        wan,
    )

    run.register(commands)
    site.register(commands)
    config_watch.register(commands)
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
        say(str(exc), "ERROR", prefix=f"{args.prog}: error: ")
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `isthmus check JOB | head -3`: the reader has what it wanted
        # Python would complain again flushing stdout at exit: point it at nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # a known kind of bad input may surface from deep inside
        from isthmus.job.file import JobFileError

        if isinstance(exc, JobFileError):
            for line in exc.lines():
                say(line, "ERROR", prefix="error: ")
            return 2
        raise


__all__ = ["Command", "UsageError", "add_command", "build_parser", "main"]

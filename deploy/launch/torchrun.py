"""torchrun for ``isthmus site``, without its crash report.

When a rank fails, torchrun's agent prints a Python traceback of its own and a
table of the failed ranks, after the rank has already said why in one line
(``isthmus site: error: ...``). Here torchrun runs as ``python -m
isthmus.deploy.launch.torchrun`` with the same arguments: a failed rank becomes
one line that names it and how it ended (which matters where it printed
nothing: a rank killed by a signal), and the exit status is the rank's.
"""

from __future__ import annotations

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def main(argv: list[str]) -> int:
    # The agent logs each failed rank at ERROR level, then the table: once is enough.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        rank, first = exc.get_first_failure()
        print(
            f"isthmus site: rank {rank} {how_it_ended(first.exitcode)} "
            f"(pid {first.pid}); the site's other ranks were stopped",
            file=sys.stderr,
        )
        return first.exitcode if first.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

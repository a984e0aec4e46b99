"""Fuzz the job-file parser and a peer's chunk handler for a fixed time; print crashes and hangs.

The failure-handling issue's target: 0 crashes and 0 hangs. A crash is any
exception other than the target's refusal (a ``JobFileError`` naming the
field; an acknowledgement refusing the chunk); a hang is an input that takes
longer than ``--hang-s``. Inputs come from hypothesis strategies
(``tests/fuzzing.py``): random job documents over the real keys, mutations of
the example job files, random text; chunk messages with random fields and
payloads, most with a correct checksum so the decoders are reached.

    python benchmarks/fuzz.py [--seconds 60] [--hang-s 5]
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import contextlib

from fuzzing import JOB_TEXTS, chunk_messages, chunk_target, job_file_target
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st


class _Hang(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise _Hang()


def fuzz(
    name: str, strategy: Any, target: Callable[..., Any], seconds: float, hang_s: float
) -> dict[str, Any]:
    """Feed ``target`` inputs drawn from ``strategy`` until ``seconds`` pass."""
    counts = {"inputs": 0, "crashes": 0, "hangs": 0}
    first_crash: list[str] = []
    deadline = time.monotonic() + seconds

    @settings(
        max_examples=10**9,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def one(args: tuple) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError  # the budget is spent: ends the run
        counts["inputs"] += 1
        signal.setitimer(signal.ITIMER_REAL, hang_s)
        try:
            target(*args)
        except _Hang:
            counts["hangs"] += 1
        except Exception as exc:
            counts["crashes"] += 1
            if not first_crash:
                first_crash.append("".join(traceback.format_exception(exc)[-3:]))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    with contextlib.suppress(TimeoutError):
        one()
    print(
        f"{name}: {counts['inputs']:,} inputs in {seconds:g} s, "
        f"{counts['crashes']} crashes, {counts['hangs']} hangs",
        flush=True,
    )
    if first_crash:
        print(first_crash[0])
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="per target")
    parser.add_argument("--hang-s", type=float, default=5.0)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # every refusal is logged; thousands of them here
    signal.signal(signal.SIGALRM, _alarm)
    results = [
        fuzz(
            "job-file parser",
            st.tuples(JOB_TEXTS),
            job_file_target,
            args.seconds,
            args.hang_s,
        ),
        fuzz(
            "peer chunk handler",
            st.tuples(chunk_messages(), st.one_of(st.none(), st.integers(0, 5000))),
            chunk_target,
            args.seconds,
            args.hang_s,
        ),
    ]
    return 1 if any(r["crashes"] or r["hangs"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One line, not a traceback, for the errors a site process can meet.

Bad input (job file, addresses, layout, settings) exits 2 with the field and
the fix; a peer or round failure (unreachable, refused, late) exits 1 with the
site and link it names, an unreachable control-plane broker with its address.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from isthmus.inter.agreement import ModelMismatch
from isthmus.inter.allreduce import RoundError
from isthmus.inter.membership import MembershipError
from isthmus.inter.peer import PeerError
from isthmus.inter.tls import TlsError
from isthmus.intra.devices import out_of_memory_message
from isthmus.intra.process_group import SiteError
from isthmus.job.addressing import AddressError
from isthmus.job.file import JobFileError
from isthmus.job.layout import LayoutError
from isthmus.job.settings import SettingError
from isthmus.training.environment import NotLaunched
from isthmus.training.log_format import say


def run_site_main(main: Callable[[], int], prog: str, reach_hint: str | None = None) -> int:
    """Run ``main``; an error a site can meet becomes one line and an exit status.
    ``reach_hint`` is the command that lists what must be open (``isthmus site
    ... --print-ports``): a peer or broker this site could not reach names it."""
    try:
        return main()
    except JobFileError as exc:
        for line in exc.lines():
            say(line, "ERROR", prefix=f"{prog}: error: ")
        return 2
    except (
        AddressError,
        LayoutError,
        SettingError,
        SiteError,
        NotLaunched,
        ModelMismatch,
        TlsError,
    ) as exc:
        say(str(exc), "ERROR", prefix=f"{prog}: error: ")
        return 2
    except (PeerError, RoundError, ConnectionError) as exc:
        hint = f"; what must be open: {reach_hint}" if reach_hint else ""
        say(f"{exc}{hint}", "ERROR", prefix=f"{prog}: error: ")
        return 1
    except MembershipError as exc:
        say(str(exc), "ERROR", prefix=f"{prog}: error: ")
        return 1
    except torch.OutOfMemoryError as exc:
        site, rank = os.environ.get("ISTHMUS_SITE", "?"), int(os.environ.get("RANK", "0"))
        say(out_of_memory_message(exc, site, rank), "ERROR", prefix=f"{prog}: error: ")
        return 1
    except KeyboardInterrupt:
        return 130

"""Processes that ``isthmus run`` starts end when it does, however it ends.

The launcher starts the site processes and the WAN emulator in sessions of
their own, so that a terminal's Ctrl-C reaches the launcher alone and it stops
them in order. If the launcher itself is killed (SIGKILL, the OOM killer, a
test's cleanup) nothing would stop them: they would train or forward on,
orphaned, holding ports and cores. So the launcher names itself in
``ISTHMUS_PARENT_PID`` and each child watches for its parent to change.

Linux's ``PR_SET_PDEATHSIG`` would do this without a thread, but it fires when
the *thread* that forked the child exits, which would tie a site's life to a
thread of the launcher rather than to the launcher; and setting it needs a
``preexec_fn``, which is unsafe in a process that runs threads.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

PARENT_ENV = "ISTHMUS_PARENT_PID"
CHECK_EVERY_S = 1.0
GRACE_S = 30.0
"""After SIGTERM, how long a process may take to stop cleanly before it exits hard."""


def parent_environment() -> dict[str, str]:
    """What the launcher adds to a child's environment so that it ends with it."""
    return {PARENT_ENV: str(os.getpid())}


def end_with_parent() -> None:
    """If the launcher named itself in the environment, send this process SIGTERM
    once that parent is gone (and exit hard if it has not ended ``GRACE_S`` later).
    The variable is taken out of the environment: this process's own children have
    another parent."""
    value = os.environ.pop(PARENT_ENV, None)
    if not value:
        return
    try:
        parent = int(value)
    except ValueError:
        log.warning("ignoring %s=%r: not a process id", PARENT_ENV, value)
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(CHECK_EVERY_S)
        log.warning("the launcher (pid %d) is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="isthmus-end-with-parent", daemon=True).start()

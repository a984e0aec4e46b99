"""An asyncio event loop on its own thread, for synchronous training code.

The WAN endpoint is asyncio (grpc.aio); a training loop is not. The loop runs
on a daemon thread for the life of the site, so connections and their
flow-control windows stay warm between rounds, and the training thread hands
it coroutines with :meth:`BackgroundLoop.run` (wait) or :meth:`submit`
(carry on, collect the result later).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    def __init__(self, name: str = "isthmus-wan") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop; its result comes through the returned future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (its exception is raised here)."""
        return self.submit(coro).result(timeout)

    def close(self, grace_s: float = 5.0) -> None:
        """Cancel what still runs on the loop (a site that stops mid-round has
        streams in flight), give it ``grace_s`` to unwind, then stop the loop.
        Tasks left pending when a loop closes end in noise at interpreter exit."""
        if not self.loop.is_running():
            return
        with contextlib.suppress(Exception):
            self.run(_cancel_other_tasks(grace_s), timeout=grace_s + 1)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    def __enter__(self) -> BackgroundLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _cancel_other_tasks(grace_s: float) -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=grace_s)
    await asyncio.get_running_loop().shutdown_asyncgens()

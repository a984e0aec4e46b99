"""An MQTT broker for a run that names none: amqtt, embedded, on a free loopback port.

``isthmus run`` starts one so the first run needs nothing installed; a real
deployment names its own broker (Mosquitto: ``deploy/mosquitto/``) in the job
file's ``control:`` section. amqtt speaks MQTT 3.1.1 only, which is all the
control plane uses; it also hands a new client retained messages of other
clients' subscriptions, so receivers filter by topic (they do).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from pathlib import Path
from typing import Any

from isthmus.job.broker import Broker
from isthmus.job.model import Job
from isthmus.job.ports import free_port


def control_state_path(job: Job) -> Path:
    """Where ``isthmus run`` writes the embedded broker's address: ./<job>.control.json."""
    return Path(f"{job.name}.control.json")


class BrokerStartError(RuntimeError):
    """The embedded broker did not start; the message says why and what to do."""


class EmbeddedBroker:
    """amqtt on its own thread and loop, listening on 127.0.0.1 only."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="isthmus-broker", daemon=True
        )
        self._broker: Any = None
        # amqtt logs every connection at INFO; keep a run's output for what matters.
        for name in ("amqtt", "transitions"):
            logging.getLogger(name).setLevel(logging.WARNING)

    @property
    def address(self) -> Broker:
        return Broker(self.host, self.port)

    def start(self) -> EmbeddedBroker:
        from amqtt.broker import Broker as AmqttBroker

        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}
            },
        }
        self._thread.start()

        async def start() -> Any:
            broker = AmqttBroker(config)
            await broker.start()
            return broker

        try:
            self._broker = asyncio.run_coroutine_threadsafe(start(), self._loop).result(30)
        except Exception as exc:  # amqtt missing a plugin's dependency, the port taken, ...
            self.stop()
            raise BrokerStartError(
                f"the embedded MQTT broker (amqtt) did not start on {self.host}:{self.port}: "
                f"{type(exc).__name__}: {exc or 'no answer in 30 s'}; reinstall Isthmus's "
                "dependencies (pip install isthmus brings amqtt's), or name a "
                "broker of your own under control.broker (docs/control-plane.md)"
            ) from exc
        return self

    def stop(self) -> None:
        if self._broker is not None:
            # Already gone or not answering: nothing is left to release but the thread.
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._broker.shutdown(), self._loop).result(10)
            self._broker = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

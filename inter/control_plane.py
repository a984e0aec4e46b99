"""The control plane's client: membership, live settings and telemetry over MQTT.

One :class:`ControlPlane` per site (on the rank that reports for it) runs an
aiomqtt client on its own thread and event loop, so training never waits on
the broker: calls from the training loop only hand messages over. When the
broker is unreachable the client retries with backoff and, on every
(re)connection, publishes the site's retained status again; the Last Will
(retained ``state: offline``) tells everyone within a few seconds when the
site's connection dies. Topics and payloads: :mod:`isthmus.inter.control_topics`.

Live settings apply at an outer round boundary: a config message names the
round from which it holds (``from_round``), chosen by the publisher ahead of
every site's current round, so every site switches at the same round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import threading
import time
from typing import Any

from isthmus.inter.control_topics import (
    PROTOCOL,
    ConfigChange,
    config_topic,
    decode,
    encode,
    membership_topic,
    metrics_topic,
    parse_config,
    parse_metrics,
    parse_status,
    site_of,
    status_topic,
)
from isthmus.inter.membership import Membership
from isthmus.job.broker import Broker
from isthmus.job.settings import TrainSettings

log = logging.getLogger("isthmus.control")

MAX_IN_FLIGHT = 8
"""Publishes handed to the client and not yet written: beyond it, metrics are
dropped (counted) and status updates wait to send only the latest."""
KEEPALIVE_S = 5
"""MQTT keepalive. A dead process's Last Will goes out at once (the kernel closes
its socket); the keepalive only bounds how fast a hung or cut-off host is found
(the broker drops a silent client after 1.5 keepalives; Mosquitto checks every
few seconds). It is also how long the client waits for a PINGRESP before it
drops the connection itself: at 1 s, a client thread or broker starved of CPU
for a second (three sites' containers and a broker on 2 cores) lost its
connection mid-run, its Last Will went out, and the site was left out of the
next view."""
BACKOFF_S = (0.2, 5.0)


class ControlPlane:
    """One site's link to the control plane (or an observer's, with ``site=None``)."""

    def __init__(
        self,
        broker: Broker,
        job: str,
        site: str | None,
        *,
        settings: TrainSettings | None = None,
        status: dict[str, Any] | None = None,
        keepalive_s: int = KEEPALIVE_S,
        membership: Membership | None = None,
    ) -> None:
        """``membership``: this site's side of the membership protocol, fed with
        every status and view, its reports sent in this site's status."""
        self.broker = broker
        self.job = job
        self.site = site
        self.settings = settings or TrainSettings()
        self.keepalive_s = keepalive_s
        self._status: dict[str, Any] = {"state": "online", "protocol": PROTOCOL, **(status or {})}
        self._lock = threading.Lock()
        self.peers: dict[str, dict[str, Any]] = {}
        """Every site's last status, by name (this one's too)."""
        self.heard_at: dict[str, float] = {}
        """When (``time.monotonic()``, this host's) each site's last status arrived: how
        long a site has been quiet, measured without its clock (sites' clocks differ;
        the ``t`` a status carries is the sender's)."""
        self.metrics: dict[str, dict[str, Any]] = {}
        """Every site's last metrics message, by name."""
        self.config: ConfigChange | None = None
        """The newest valid config message seen."""
        self.view: dict[str, Any] | None = None
        """The newest membership view message seen, as received."""
        self._applied_version = -1
        self.connected = threading.Event()
        self.connections = 0
        self.ignored = 0
        """Messages ignored as malformed or refused (each logged once)."""
        self.unsent_metrics = 0
        """Metrics messages dropped while the broker was unreachable."""
        self._loop = asyncio.new_event_loop()
        self._client: Any = None
        self._stopping = False
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"isthmus-control-{site or 'observer'}", daemon=True
        )
        self._task: asyncio.Future[None] | None = None
        self._run_task: asyncio.Task[None] | None = None
        """The client's task on the loop, ended alone first when closing (see
        :meth:`_goodbye`)."""
        self._sending: set[asyncio.Future[None]] = set()
        self._status_in_flight = False
        self._status_dirty = False
        self._metrics_in_flight = 0
        self.membership = membership
        if membership is not None:
            # In the first status already: a joining site must say so to be let in.
            self._status["membership"] = membership.report_message()
            membership.publish_report = lambda report: self.update_status(membership=report)
            # An observer (another rank of the site) follows the views; it never leads.
            membership.publish_view = self._publish_view if site is not None else None

    # -- life ----------------------------------------------------------------------
    def start(self, wait_s: float | None = None) -> ControlPlane:
        """Start the client; with ``wait_s``, wait that long for the first connection
        and raise naming the broker if there is none."""
        try:
            self.broker.tls_context()  # bad TLS files: say so now, not "no broker"
        except (OSError, ssl.SSLError) as exc:
            files = ", ".join(f for f in (self.broker.tls_ca, self.broker.tls_cert) if f)
            raise ConnectionError(
                f"control plane: cannot load the TLS files ({files}): {exc}; fix control.tls "
                "in the job file"
            ) from None
        self._thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self._run(), self._loop)  # type: ignore[assignment]
        if wait_s is not None and not self.connected.wait(wait_s):
            self.close()
            raise ConnectionError(
                f"control plane: no MQTT broker answered at {self.broker.url} within "
                f"{wait_s:g} s; start one there or fix control.broker in the job file"
            )
        return self

    def close(self, timeout_s: float = 3.0) -> None:
        """Publish this site's offline status (a clean exit sends no Last Will) and stop."""
        if self._stopping or not self._thread.is_alive():
            return
        self._stopping = True
        future = asyncio.run_coroutine_threadsafe(self._goodbye(timeout_s), self._loop)
        with contextlib.suppress(Exception):  # the broker is gone: its Last Will says the same
            future.result(timeout_s * 3)
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop).result(timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()

    async def _cancel_all(self) -> None:
        """Cancel the client and any publish in flight, and let them finish."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the training loop calls (never blocks) ---------------------------------
    def update_status(self, **fields: Any) -> None:
        with self._lock:
            self._status.update(fields)
        self._call(self._publish_status)

    def publish_metrics(self, **fields: Any) -> None:
        if self.site is None:
            return
        message = {"t": time.time(), **fields}
        with self._lock:
            if not self.connected.is_set() or self._metrics_in_flight >= MAX_IN_FLIGHT:
                self.unsent_metrics += 1
                return
            self._metrics_in_flight += 1
        topic = metrics_topic(self.job, self.site)
        self._call(self._publish, topic, encode(message), False, self._metrics_sent)

    def _metrics_sent(self) -> None:
        with self._lock:
            self._metrics_in_flight -= 1

    def changes_due(self, outer_round: int) -> dict[str, Any]:
        """Settings to apply now, at outer round ``outer_round``: those of the newest
        config whose ``from_round`` has come, once."""
        config = self.config
        if config is None or config.version <= self._applied_version:
            return {}
        if outer_round < config.from_round:
            return {}
        self._applied_version = config.version
        if outer_round > config.from_round:
            log.warning(
                "config version %d was for round %d; this site applies it at round %d "
                "(it arrived late)",
                config.version,
                config.from_round,
                outer_round,
            )
        return dict(config.settings)

    def publish_config(
        self, settings: dict[str, Any], from_round: int, timeout_s: float = 5.0
    ) -> int:
        """Publish live settings (retained, QoS 1) that every site applies from outer
        round ``from_round``; returns the new version. Raises ``ConnectionError`` if the
        broker does not take it within ``timeout_s``."""
        version = (self.config.version if self.config else 0) + 1
        message = {
            "protocol": PROTOCOL,
            "settings": settings,
            "from_round": from_round,
            "version": version,
            "t": time.time(),
        }

        async def send() -> None:
            client = self._client
            if client is None:
                raise ConnectionError(f"control plane: not connected to {self.broker.url}")
            await client.publish(config_topic(self.job), encode(message), qos=1, retain=True)

        future = asyncio.run_coroutine_threadsafe(send(), self._loop)
        try:
            future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise ConnectionError(
                f"control plane: {self.broker.url} did not take the config in {timeout_s:g} s"
            ) from None
        except Exception as exc:
            raise ConnectionError(f"control plane: config not published: {exc}") from None
        return version

    # -- the client's own loop -------------------------------------------------------
    def _call(self, fn: Any, *args: Any) -> None:
        if self._thread.is_alive() and not self._stopping:
            self._loop.call_soon_threadsafe(fn, *args)

    def _status_message(self, state: str | None = None) -> bytes:
        with self._lock:
            status = {**self._status, "t": time.time()}
        if state is not None:
            status["state"] = state
        return encode(status)

    def _publish_status(self) -> None:
        """Send the latest status; while one is in flight, send again only once it is
        written (intermediate updates are superseded, never queued)."""
        if self.site is None or self._stopping:
            return  # stopping: the goodbye carries the latest status
        if self._status_in_flight:
            self._status_dirty = True
            return
        self._status_in_flight = True
        self._publish(
            status_topic(self.job, self.site), self._status_message(), True, self._status_sent
        )

    def _status_sent(self) -> None:
        self._status_in_flight = False
        if self._status_dirty:
            self._status_dirty = False
            self._publish_status()

    def _publish(self, topic: str, payload: bytes, retain: bool, then: Any = None) -> None:
        """Fire and forget (QoS 0): over one TCP connection nothing is lost while it
        lasts, a reconnection re-publishes the status, and no acknowledgement can
        pile up behind a slow broker. The Last Will and the goodbye use QoS 1."""
        client = self._client
        if client is None:
            if then is not None:
                then()
            return

        async def send() -> None:
            try:
                await client.publish(topic, payload, qos=0, retain=retain)
            except Exception as exc:  # the reconnect loop handles the outage
                log.debug("publish to %s failed: %s", topic, exc)
            finally:
                if then is not None:
                    then()

        task = asyncio.ensure_future(send())
        self._sending.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._sending.discard)

    async def _run(self) -> None:
        import aiomqtt

        self._run_task = asyncio.current_task()

        delay = BACKOFF_S[0]
        identifier = f"isthmus-{self.job}-{self.site or 'observer'}-{id(self):x}"
        will = None
        if self.site is not None:
            will = aiomqtt.Will(
                status_topic(self.job, self.site),
                self._status_message("offline"),
                qos=1,
                retain=True,
            )
        outage_logged = False
        while not self._stopping:
            try:
                async with self.broker.client(
                    identifier, will=will, keepalive=self.keepalive_s, timeout=5
                ) as client:
                    self._client = client
                    await client.subscribe(config_topic(self.job), qos=1)
                    await client.subscribe(f"isthmus/{self.job}/sites/+/status", qos=1)
                    await client.subscribe(f"isthmus/{self.job}/metrics/+", qos=0)
                    await client.subscribe(membership_topic(self.job), qos=1)
                    self.connections += 1
                    self.connected.set()
                    if outage_logged:
                        log.info("control plane: reconnected to %s", self.broker.url)
                    outage_logged = False
                    delay = BACKOFF_S[0]
                    self._publish_status()
                    async for message in client.messages:
                        self._receive(str(message.topic), message.payload)
            except aiomqtt.MqttError as exc:
                if not outage_logged and not self._stopping:
                    log.warning(
                        "control plane: broker %s unreachable (%s); training goes on, "
                        "retrying with backoff",
                        self.broker.url,
                        exc,
                    )
                    outage_logged = True
            finally:
                self._client = None
                self.connected.clear()
            if not self._stopping:
                await asyncio.sleep(delay)
                delay = min(BACKOFF_S[1], delay * 2)

    async def _goodbye(self, timeout_s: float) -> None:
        """Publish the offline status, then end the session with a DISCONNECT.

        The order matters. First what is still being sent; then the goodbye; then
        the DISCONNECT, since the Last Will is the status as it was at connect time
        (a site's membership report then: training, 0 rounds), and the broker
        sends it for any session that ends without a DISCONNECT. A site that
        reported itself done and then dropped its connection without one would
        be overwritten by that old status and taken for lost. Ending the client's
        ``async with`` (cancelling its task alone, while the client's own
        reader and writer still run) sends the DISCONNECT."""
        client = self._client
        if self._sending:
            # A status sent just before (a site's "done") must not land after the
            # goodbye: retained, it would say the site is online once it is gone.
            await asyncio.wait(set(self._sending), timeout=timeout_s)
        if client is not None and self.site is not None:
            await client.publish(
                status_topic(self.job, self.site),
                self._status_message("offline"),
                qos=1,
                retain=True,
            )
        run = self._run_task
        if run is not None and not run.done():
            run.cancel()
            await asyncio.wait({run}, timeout=timeout_s)

    def _publish_view(self, view: Any) -> None:
        """A membership view, retained, QoS 1: every site must see it, also a site that
        connects later. Called from this client's thread, the training thread, or the
        leader's timer that ends its wait for the members' reports."""
        payload = encode({**view.to_message(), "t": time.time()})

        async def send() -> None:
            client = self._client
            if client is None:
                log.warning("control plane: not connected; view %d not published", view.epoch)
                return
            try:
                await client.publish(membership_topic(self.job), payload, qos=1, retain=True)
            except Exception as exc:
                log.warning("control plane: view %d not published: %s", view.epoch, exc)

        if self._thread.is_alive() and not self._stopping:
            asyncio.run_coroutine_threadsafe(send(), self._loop)

    def _receive(self, topic: str, payload: Any) -> None:
        message = decode(payload)
        if isinstance(message, str):
            return self._ignore(topic, message)
        if topic == membership_topic(self.job):
            self.view = message  # for observers (isthmus watch); a site checks it below
            if self.membership is not None:
                problem = self.membership.on_view(message)
                if problem:
                    return self._ignore(topic, problem)
            return None
        if topic == config_topic(self.job):
            change = parse_config(message, self.settings)
            if isinstance(change, str):
                return self._ignore(topic, change)
            if self.config is None or change.version > self.config.version:
                self.config = change
            return None
        kind = site_of(topic, self.job)
        if kind is None:
            return None  # another job's, or a topic this client does not use
        parse = parse_status if kind[0] == "status" else parse_metrics
        checked = parse(message)
        if isinstance(checked, str):
            return self._ignore(topic, checked)
        (self.peers if kind[0] == "status" else self.metrics)[kind[1]] = checked
        if kind[0] == "status":
            self.heard_at[kind[1]] = time.monotonic()
        if kind[0] == "status" and self.membership is not None:
            problem = self.membership.on_status(kind[1], checked)
            if problem:
                return self._ignore(topic, problem)
        return None

    def _ignore(self, topic: str, reason: str) -> None:
        self.ignored += 1
        log.warning("control plane: ignored a message on %s: %s", topic, reason)

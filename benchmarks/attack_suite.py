"""The attack suite: a TLS job of three sites trained twice, undisturbed and under attack.

``python benchmarks/attack_suite.py [--out docs/attack-suite.json]``

Both runs train the same DiLoCo job (``benchmarks/attack_site.py``, one process
per site, mutual TLS with ``isthmus certs``, a revocation list). In the
second, once site a has completed two rounds, an attacker on this machine
turns on site a's peer port, each case a number of times:

- ``plaintext``: a client without TLS;
- ``another_jobs_certificate``: a valid certificate of another job's CA;
- ``impostor``: site c's own certificate, claiming to be site b;
- ``revoked``: site c's old certificate, revoked by the job's CA (``tls.crl``);
- ``replayed_chunk``: with site c's certificate (a stolen key), a chunk of
  round 0, which is over;
- ``oversized_message``: a chunk message over the size limit;
- ``stream_flood``: 1,000 streams at once from one peer (site c's certificate);
- ``broker_settings``: with a real Mosquitto configured by ``isthmus deploy
  render`` (client certificates, the job's ACL), a client without a
  certificate and a site's client publish live settings, and an honest site
  listening; the operator's certificate publishes once as the control.

Reported per case: attempts, what the attacker saw (refused or not) and what
site a counted and logged; and whether the attacked run's model equals the
undisturbed run's (``param_sha256``). Exit status 1 if any attack got through.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import torch
from example_sites import loopback_job

from isthmus.deploy.render.certs import make_certs, revoke_site
from isthmus.inter.chunks import encode_chunks
from isthmus.inter.codecs import parse_codec
from isthmus.inter.peer import META_JOB, META_RANK, META_SITE, Identity, PeerError
from isthmus.inter.peer_client import PeerClient
from isthmus.inter.tls import SiteTls
from isthmus.inter.transport import TransportSettings
from isthmus.proto import wire_pb2, wire_pb2_grpc

HERE = Path(__file__).resolve().parent
JOB = "attacked"
SITES = ("a", "b", "c")


def _progress(tick: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {tick}", flush=True)


def _certificates(root: Path) -> dict[str, Path]:
    """The job's certificates, another job's, and c's certificate before it was
    revoked (what a thief of its old key holds)."""
    certs, other, stolen = root / "certs", root / "other", root / "stolen"
    make_certs(JOB, SITES, certs, broker=["127.0.0.1"])
    make_certs("elsewhere", SITES, other)
    stolen.mkdir()
    for name in ("c.crt", "c.key"):
        shutil.copy(certs / name, stolen / name)
    revoke_site(JOB, "c", certs)  # c has a new certificate; the old one is revoked
    return {"certs": certs, "other": other, "stolen": stolen}


def _job_file(root: Path, name: str, files: dict[str, Path]) -> Path:
    job = loopback_job(root / name, JOB, list(SITES))
    certs = files["certs"]
    job.write_text(
        job.read_text() + f"tls: {{ca: {certs}/ca.crt, cert: '{certs}/{{site}}.crt', "
        f"key: '{certs}/{{site}}.key', crl: {certs}/revoked.crl}}\n"
    )
    return job


def _address(job: Path, site: str) -> str:
    import yaml

    for spec in yaml.safe_load(job.read_text())["sites"]:
        if spec["name"] == site:
            return spec["address"]
    raise KeyError(site)


def _start(job: Path, out: Path, args: argparse.Namespace) -> dict[str, subprocess.Popen]:
    flags = ["--steps", str(args.steps), "--sync-every", str(args.sync_every), "--out", str(out)]
    return {
        site: subprocess.Popen(
            [sys.executable, str(HERE / "attack_site.py"), str(job), site, *flags],
            stdout=subprocess.DEVNULL,
            stderr=open(out / f"{site}.log", "w"),
        )
        for site in SITES
    }


def _finish(procs: dict[str, subprocess.Popen], out: Path, timeout_s: float) -> dict[str, Any]:
    reports = {}
    for site, proc in procs.items():
        code = proc.wait(timeout=timeout_s)
        if code != 0:
            tail = (out / f"{site}.log").read_text()[-2000:]
            raise SystemExit(f"site {site} exited {code}:\n{tail}")
        reports[site] = json.loads((out / f"{site}.json").read_text())
    return reports


def _rounds(out: Path, site: str) -> int:
    try:
        return json.loads((out / f"{site}.progress").read_text())["outer_steps"]
    except (OSError, ValueError, KeyError):
        return 0


# -- the attacks -------------------------------------------------------------------------
def _tls(files: dict[str, Path], ca_dir: str, cert_dir: str, who: str) -> TransportSettings:
    """Settings built from files as they are (an attacker's program runs no checks)."""
    ca, cert, key = (
        files[ca_dir] / "ca.crt",
        files[cert_dir] / f"{who}.crt",
        files[cert_dir] / f"{who}.key",
    )
    return TransportSettings(
        tls=SiteTls(JOB, who, ca.read_bytes(), cert.read_bytes(), key.read_bytes())
    )


async def _hello(address: str, claims: str, settings: TransportSettings) -> str | None:
    """A session attempt; the refusal it met, or None if it was let in."""
    client = PeerClient(
        Identity(job=JOB, site=claims, rank=0, layout_fingerprint=""),
        address,
        settings=settings,
        deadline_s=5,
        peer_site="a",
    )
    try:
        await client.hello()
    except PeerError as exc:
        return str(exc)
    finally:
        await client.close()
    return None


def _stub(address: str, settings: TransportSettings) -> tuple[grpc.aio.Channel, Any]:
    assert settings.tls is not None
    channel = grpc.aio.secure_channel(
        address,
        settings.tls.channel_credentials(),
        options=[
            *settings.tls.channel_options("a"),
            ("grpc.max_send_message_length", 1 << 30),
            ("grpc.use_local_subchannel_pool", 1),
        ],
    )
    return channel, wire_pb2_grpc.PeerServiceStub(channel)


AS_C = ((META_JOB, JOB), (META_SITE, "c"), (META_RANK, "0"))


async def _stream(stub: Any, chunks: list[wire_pb2.Chunk], hold_s: float = 0.0) -> str:
    """One Exchange stream as site c: its chunks, then held open ``hold_s``; how it ended."""

    async def requests():
        for chunk in chunks:
            yield chunk
        await asyncio.sleep(hold_s)

    try:
        acks = [ack async for ack in stub.Exchange(requests(), metadata=AS_C, timeout=30)]
    except grpc.aio.AioRpcError as exc:
        return f"refused: {exc.code().name}: {exc.details()}"
    if not acks:
        return "admitted"  # a stream within the limit, which carried nothing
    return "acknowledged" if all(a.ok for a in acks) else f"refused: {acks[0].error.message}"


def _old_chunk() -> wire_pb2.Chunk:
    [chunk] = encode_chunks(
        parse_codec("none"), torch.zeros(1024), round=0, shard=0, max_chunk_bytes=1 << 20
    )
    return chunk


Attack = Callable[[str, dict[str, Path], int], Awaitable[list[str]]]


async def plaintext(address: str, files: dict[str, Path], n: int) -> list[str]:
    return await _many(n, lambda: _hello(address, "b", TransportSettings()))


async def another_jobs_certificate(address: str, files: dict[str, Path], n: int) -> list[str]:
    settings = _tls(files, "other", "other", "b")
    return await _many(n, lambda: _hello(address, "b", settings))


async def impostor(address: str, files: dict[str, Path], n: int) -> list[str]:
    settings = _tls(files, "certs", "certs", "c")  # c's own, valid certificate
    return await _many(n, lambda: _hello(address, "b", settings))


async def revoked(address: str, files: dict[str, Path], n: int) -> list[str]:
    settings = _tls(files, "certs", "stolen", "c")
    return await _many(n, lambda: _hello(address, "c", settings))


async def _many(n: int, attempt: Callable[[], Awaitable[str | None]]) -> list[str]:
    """``n`` attempts at once; each one's refusal, or "accepted"."""
    return [r or "accepted" for r in await asyncio.gather(*[attempt() for _ in range(n)])]


async def replayed_chunk(address: str, files: dict[str, Path], n: int) -> list[str]:
    channel, stub = _stub(address, _tls(files, "certs", "certs", "c"))
    try:
        # Acknowledged (the sender has nothing to send again) but dropped, unapplied:
        # site a counts each as STALE_ROUND, which is what this case checks.
        return list(await asyncio.gather(*[_stream(stub, [_old_chunk()]) for _ in range(n)]))
    finally:
        await channel.close()


async def oversized_message(address: str, files: dict[str, Path], n: int) -> list[str]:
    channel, stub = _stub(address, _tls(files, "certs", "certs", "c"))
    big = wire_pb2.Chunk(round=0, payload=b"\0" * (TransportSettings().max_message_bytes + 4096))
    try:
        return list(await asyncio.gather(*[_stream(stub, [big]) for _ in range(n)]))
    finally:
        await channel.close()


async def stream_flood(address: str, files: dict[str, Path], n: int) -> list[str]:
    # Over ten connections, so that HTTP/2's per-connection limit does not queue
    # them in the attacker's own process: the site's own limit must cut them off.
    settings = _tls(files, "certs", "certs", "c")
    channels = [_stub(address, settings) for _ in range(10)]
    try:
        streams = [_stream(channels[i % 10][1], [], hold_s=2.0) for i in range(n)]
        return list(await asyncio.gather(*streams))
    finally:
        for channel, _ in channels:
            await channel.close()


ATTACKS: dict[str, tuple[Attack, int, str]] = {
    # case: (attack, attempts, what site a counts it as; "" = the TLS handshake fails)
    "plaintext": (plaintext, 20, ""),
    "another_jobs_certificate": (another_jobs_certificate, 20, ""),
    "impostor": (impostor, 20, "WRONG_JOB"),
    "revoked": (revoked, 20, "REVOKED"),
    "replayed_chunk": (replayed_chunk, 20, "STALE_ROUND"),
    "oversized_message": (oversized_message, 20, "TOO_LARGE"),
    "stream_flood": (stream_flood, 1000, "TOO_MANY_STREAMS"),
}


async def _attack(
    address: str, files: dict[str, Path], names: list[str]
) -> dict[str, dict[str, Any]]:
    results = {}
    for name in names:
        attack, attempts, _ = ATTACKS[name]
        outcomes = await attack(address, files, attempts)
        refused = [o for o in outcomes if o.startswith(("refused", "peer"))]
        results[name] = {
            "attempts": attempts,
            "refused_as_the_attacker_saw": len(refused),
            "acknowledged": outcomes.count("acknowledged"),
            "admitted_within_limit": outcomes.count("admitted"),
            "example": (refused or outcomes)[0][:240],
        }
        _progress(f"  {name}: {attempts} attempts, {len(refused)} refused")
    return results


def _judge(name: str, case: dict[str, Any]) -> bool:
    """Whether the case was refused as it should be (the model is checked apart)."""
    n, counted = case["attempts"], case["counted_by_site"]
    if name in ("plaintext", "another_jobs_certificate"):
        return case["refused_as_the_attacker_saw"] == n  # the TLS handshake failed
    if name == "replayed_chunk":
        return counted == n  # acknowledged, dropped unapplied, counted as STALE_ROUND
    if name == "stream_flood":
        limit = TransportSettings().max_streams_per_site
        return case["refused_as_the_attacker_saw"] >= n - limit and counted >= n - limit
    return case["refused_as_the_attacker_saw"] == n and counted == n


# -- the broker ------------------------------------------------------------------------
def broker_settings(root: Path, files: dict[str, Path], n: int = 20) -> dict[str, Any]:
    """Mosquitto with the configuration and ACL ``isthmus deploy render`` writes for
    the job; an honest site listens for live settings while a client without a
    certificate and site c's client try to publish them, then the operator does."""
    from isthmus.deploy.render.cluster import mosquitto_acl, mosquitto_conf
    from isthmus.inter.control_plane import Broker, ControlPlane
    from isthmus.job.file import load_job

    mosquitto = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(mosquitto).exists():
        return {"skipped": "mosquitto is not installed"}
    certs = files["certs"]
    port = _free_port()
    job_path = root / "broker-job.yaml"
    job_path.write_text(
        f"name: {JOB}\nsites: [{{name: a}}, {{name: b}}, {{name: c}}]\n"
        f"control:\n  broker: mqtts://127.0.0.1:{port}\n"
        f"  tls: {{ca: {certs}/ca.crt, cert: '{certs}/{{site}}.crt', "
        f"key: '{certs}/{{site}}.key'}}\n"
    )
    job = load_job(job_path)
    assert job.control is not None
    (root / "acl").write_text(mosquitto_acl(job))
    conf = mosquitto_conf(job, certs=str(certs), acl=str(root / "acl"))
    # Run as who we are (root would switch to a user that cannot read the keys), and
    # log denials (Mosquitto logs a refused PUBLISH at its debug level).
    conf += (
        f"user {os.environ.get('USER', 'root')}\nlog_type all\nlog_dest file {root}/mosquitto.log\n"
    )
    (root / "mosquitto.conf").write_text(conf)
    server = subprocess.Popen([mosquitto, "-c", str(root / "mosquitto.conf")])
    try:
        _wait_listening(port)
        honest = ControlPlane(job.control.broker_for("b"), JOB, "b").start(wait_s=10)
        no_certificate = Broker("127.0.0.1", port, tls_ca=str(certs / "ca.crt"))
        refused = 0
        for _ in range(n):
            try:
                ControlPlane(no_certificate, JOB, "c").start(wait_s=2).close()
            except ConnectionError:
                refused += 1
        with ControlPlane(job.control.broker_for("c"), JOB, "c").start(wait_s=10) as site_c:
            for i in range(n):
                site_c.publish_config({"sync_every": 7 + i}, from_round=10**6)
        time.sleep(1.0)  # time for a message the broker let through to arrive
        applied_before_operator = honest.config is not None
        with ControlPlane(job.control.broker_for(None), JOB, None).start(wait_s=10) as operator:
            operator.publish_config({"sync_every": 99}, from_round=10**6)
        deadline = time.monotonic() + 10
        while honest.config is None and time.monotonic() < deadline:
            time.sleep(0.05)
        operator_arrived = honest.config is not None and honest.config.settings == {
            "sync_every": 99
        }
        honest.close()
    finally:
        server.terminate()
        server.wait(10)
    log = (root / "mosquitto.log").read_text(errors="replace")
    return {
        "attempts": 2 * n,
        "refused_as_the_attacker_saw": refused,
        "site_certificate_publishes": n,
        "settings_reaching_a_site": int(applied_before_operator),
        "denied_publish_lines_in_the_broker_log": log.count("Denied PUBLISH"),
        "operators_settings_arrived (the control)": operator_arrived,
        "counted_as": "TLS handshake (no certificate); ACL (site certificate)",
        "held": refused == n and not applied_before_operator and operator_arrived,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, timeout_s: float = 10.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit(f"mosquitto did not listen on {port} in {timeout_s:g} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="isthmus-attacks-"))
    files = _certificates(root)

    _progress("run 1: undisturbed")
    job = _job_file(root, "quiet.yaml", files)
    (root / "quiet").mkdir()
    (root / "quiet" / "go-on").touch()
    quiet = _finish(_start(job, root / "quiet", args), root / "quiet", 600)

    _progress("run 2: under attack")
    job = _job_file(root, "attacked.yaml", files)
    out = root / "attacked"
    out.mkdir()
    procs = _start(job, out, args)
    while _rounds(out, "a") < 2:  # the sites now wait between rounds for go-on
        if any(p.poll() is not None for p in procs.values()):
            raise SystemExit(_finish(procs, out, 60) and "the sites ended before round 2")
        time.sleep(0.1)
    address = _address(job, "a")
    between = [n for n in ATTACKS if n != "stream_flood"]
    attacks = asyncio.run(_attack(address, files, between))
    (out / "go-on").touch()  # training goes on; the flood comes while rounds run
    flood_began = _rounds(out, "a")
    attacks.update(asyncio.run(_attack(address, files, ["stream_flood"])))
    flood_ended = _rounds(out, "a")
    attacked = _finish(procs, out, 600)
    _progress("the broker: live settings from a client without the operator's certificate")
    attacks["broker_settings"] = broker_settings(root, files)
    counted = attacked["a"]["refusals"]
    log = (out / "a.log").read_text()
    for name, (_, _, kind) in ATTACKS.items():  # the broker's case judged itself
        attacks[name]["counted_as"] = kind or "TLS handshake (gRPC core)"
        attacks[name]["counted_by_site"] = counted.get(kind, 0) if kind else None
        attacks[name]["held"] = _judge(name, attacks[name])
    result = {
        "sites": list(SITES),
        "rounds": attacked["a"]["outer_steps"],
        "attacks_between_rounds": 2,
        "stream_flood_during_rounds": [flood_began, flood_ended],
        "attacks": attacks,
        "refusals_at_site_a": counted,
        "refusal_log_lines_at_site_a": sum("refused:" in line for line in log.splitlines()),
        "undisturbed_param_sha256": quiet["a"]["param_sha256"],
        "attacked_param_sha256": attacked["a"]["param_sha256"],
        "model_unchanged": len({r["param_sha256"] for r in [*quiet.values(), *attacked.values()]})
        == 1,
        "wall_seconds": {
            "undisturbed": quiet["a"]["wall_seconds"],
            "attacked_with_the_pause": attacked["a"]["wall_seconds"],
        },
    }
    held = all(case.get("held", True) for case in attacks.values())
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    return 0 if result["model_unchanged"] and held else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Mutual TLS between sites over real gRPC: certificates of the job's CA, and refusals."""

from __future__ import annotations

import asyncio
import logging
import stat
import subprocess
import sys

import pytest
import torch
from test_cli import in_process

from isthmus.deploy.render.certs import make_certs
from isthmus.inter.chunks import encode_chunks
from isthmus.inter.codecs import parse_codec
from isthmus.inter.peer import Identity, PeerError, PeerServer
from isthmus.inter.peer_client import PeerClient
from isthmus.inter.tls import SiteTls, TlsError
from isthmus.inter.transport import TransportSettings

SITES = ("us-east", "eu-west", "ap-south")
EAST = Identity(job="demo", site="us-east", rank=0, layout_fingerprint="abc")
WEST = Identity(job="demo", site="eu-west", rank=0, layout_fingerprint="abc")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    root = tmp_path_factory.mktemp("certs")
    make_certs("demo", SITES, root / "demo")
    make_certs("other", SITES, root / "other")  # another job's CA, same site names
    return root


def tls(certs, site: str, job: str = "demo", as_site: str | None = None) -> TransportSettings:
    d = certs / job
    who = as_site or site
    # Built from the files as they are: an impostor's own program would not run the
    # checks SiteTls.load makes of a site's configuration.
    files = [d / "ca.crt", d / f"{who}.crt", d / f"{who}.key"]
    return TransportSettings(tls=SiteTls("demo", site, *(f.read_bytes() for f in files)))


async def _session(
    server_settings, client_settings, identity=WEST, peer_site="us-east", deadline_s=5.0
):
    received = []
    server = PeerServer(EAST, SITES, received.append, settings=server_settings)
    port = await server.start("127.0.0.1", 0)
    client = PeerClient(
        identity,
        f"127.0.0.1:{port}",
        settings=client_settings,
        deadline_s=deadline_s,
        peer_site=peer_site,
    )
    try:
        reply = await client.hello()
        chunks = encode_chunks(
            parse_codec("none"), torch.arange(10.0), round=0, shard=0, max_chunk_bytes=1024
        )
        acks = await client.exchange(chunks)
        return reply, acks, received, server.servicer.refused
    finally:
        await client.close()
        await server.stop()


def test_sites_with_certificates_of_the_job_ca_exchange(certs):
    reply, acks, received, refused = asyncio.run(
        _session(tls(certs, "us-east"), tls(certs, "eu-west"))
    )
    assert reply.accepted and all(a.ok for a in acks)
    assert received[0].site == "eu-west" and not refused


@pytest.mark.parametrize(
    "client",
    [
        pytest.param(lambda certs: TransportSettings(), id="plaintext"),
        pytest.param(lambda certs: tls(certs, "eu-west", job="other"), id="another-jobs-ca"),
    ],
)
def test_a_peer_without_a_certificate_of_the_job_ca_gets_nothing(certs, client):
    # The handshake fails at once; the client only waits out its deadline for a
    # connection that never comes up, so a short one checks the same.
    with pytest.raises(PeerError, match=r"unreachable|did not answer|refused"):
        asyncio.run(_session(tls(certs, "us-east"), client(certs), deadline_s=1.0))


def test_a_site_cannot_speak_for_another(certs, caplog):
    # ap-south's certificate is valid for the job, but the caller claims eu-west.
    caplog.set_level(logging.WARNING, logger="isthmus.inter.peer")
    impostor = tls(certs, "eu-west", as_site="ap-south")
    with pytest.raises(PeerError, match="certificate names \\['ap-south'\\]"):
        asyncio.run(_session(tls(certs, "us-east"), impostor))
    assert "claims site 'eu-west' but its certificate names ['ap-south']" in caplog.text
    assert "127.0.0.1" in caplog.text  # the refusal names the caller's address


def test_a_client_checks_it_reached_the_site_it_meant(certs):
    # The server is us-east; the client was told the address is ap-south's.
    with pytest.raises(PeerError):
        asyncio.run(
            _session(
                tls(certs, "us-east"), tls(certs, "eu-west"), peer_site="ap-south", deadline_s=1.0
            )
        )


def test_certs_are_written_with_private_keys_readable_by_the_owner_only(tmp_path):
    written = make_certs("job", ["a", "b"], tmp_path / "c")
    names = sorted(p.name for p in written)
    assert names == ["a.crt", "a.key", "b.crt", "b.key", "ca.crt", "ca.key"]
    for path in written:
        mode = stat.S_IMODE(path.stat().st_mode)
        if path.suffix == ".key":
            assert mode == 0o600, path
    with pytest.raises(FileExistsError, match="a certificate for every site already"):
        make_certs("job", ["a"], tmp_path / "c")
    with pytest.raises(FileExistsError, match="the CA of another job"):
        make_certs("other-job", ["a", "z"], tmp_path / "c")


def test_a_site_added_to_the_job_gets_a_certificate_of_the_same_ca(tmp_path):
    from cryptography import x509

    make_certs("job", ["a", "b"], tmp_path / "c")
    ca_before = (tmp_path / "c" / "ca.crt").read_bytes()
    a_before = (tmp_path / "c" / "a.crt").read_bytes()
    written = make_certs("job", ["a", "b", "new"], tmp_path / "c")
    assert sorted(p.name for p in written) == ["new.crt", "new.key"]
    assert (tmp_path / "c" / "ca.crt").read_bytes() == ca_before
    assert (tmp_path / "c" / "a.crt").read_bytes() == a_before
    ca = x509.load_pem_x509_certificate(ca_before)
    new = x509.load_pem_x509_certificate((tmp_path / "c" / "new.crt").read_bytes())
    new.verify_directly_issued_by(ca)


def test_certs_for_the_broker_name_its_host_and_the_operator(tmp_path, capsys):
    from cryptography import x509

    job = tmp_path / "job.yaml"
    job.write_text("name: j\nsites: [{name: a}]\n")
    code, stdout, stderr = in_process(
        capsys, "certs", str(job), "--out", str(tmp_path / "c"),
        "--broker", "broker.example", "--broker", "10.0.0.7",
    )  # fmt: skip
    assert code == 0, stderr
    assert "mqtts://broker.example:8883" in stdout
    cert = x509.load_pem_x509_certificate((tmp_path / "c" / "broker.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["broker.example"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    operator = x509.load_pem_x509_certificate((tmp_path / "c" / "operator.crt").read_bytes())
    assert operator.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == (
        "operator"
    )
    code, _, stderr = in_process(
        capsys, "certs", str(job), "--out", str(tmp_path / "d"), "--broker", "mqtt://x:1883"
    )
    assert code == 2 and "--broker: give a host name or IP address" in stderr


def test_missing_tls_files_name_the_field(tmp_path):
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(TlsError, match=r"tls\.cert: cannot read .*isthmus certs"):
        SiteTls.load("j", "a", tmp_path / "ca.crt", tmp_path / "a.crt", tmp_path / "a.key")


@pytest.mark.slow
def test_sites_train_over_mutual_tls_named_in_the_job_file(tmp_path):
    from example_sites import loopback_job, run_sites

    job = loopback_job(tmp_path / "job.yaml", "tlsjob", ["a", "b"])
    done = subprocess.run(
        [sys.executable, "-m", "isthmus", "certs", str(job), "--out", str(tmp_path / "certs")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    snippet = done.stdout.split("key (not ca.key):\n", 1)[1]
    job.write_text(job.read_text() + snippet)
    args = ["--steps", "4", "--sync-every", "2", "--batch", "2", "--corpus-bytes", "200000"]
    reports = run_sites(job, ["a", "b"], args, tmp_path, timeout_s=120)
    assert reports["a"]["param_sha256"] == reports["b"]["param_sha256"]
    assert reports["a"]["outer_steps"] == 2

    # A site whose key is missing is refused at start, naming the field and the fix.
    (tmp_path / "certs" / "b.key").unlink()
    with pytest.raises(RuntimeError, match=r"tls\.key: cannot read .*b\.key"):
        run_sites(job, ["b"], args, tmp_path, timeout_s=60)


def test_tls_files_that_would_fail_every_handshake_are_refused_naming_the_field(tmp_path):
    from isthmus.deploy.render.certs import make_certs

    make_certs("j", ["a", "b"], tmp_path / "one")
    make_certs("j", ["a", "b"], tmp_path / "two")  # the same job, another CA
    make_certs("j", ["a"], tmp_path / "old", days=0)  # expires as it is made
    one, two, old = tmp_path / "one", tmp_path / "two", tmp_path / "old"
    SiteTls.load("j", "a", one / "ca.crt", one / "a.crt", one / "a.key")  # as made: fine
    cases = [
        (
            ("j", "a", one / "ca.crt", one / "b.crt", one / "b.key"),
            r"tls\.cert: .*b\.crt is "
            r"not site 'a' of job 'j''s certificate \(it names b\.j\.isthmus, not a\.j\.isthmus\)",
        ),
        (("other", "a", one / "ca.crt", one / "a.crt", one / "a.key"), "not a.other.isthmus"),
        (
            ("j", "a", one / "ca.crt", two / "a.crt", two / "a.key"),
            r"tls\.cert: .*a\.crt is not signed by the job's CA",
        ),
        (
            ("j", "a", one / "ca.crt", one / "a.crt", one / "b.key"),
            r"tls\.key: .*b\.key is not the key of .*a\.crt",
        ),
        (("j", "a", old / "ca.crt", old / "a.crt", old / "a.key"), r"tls\.cert: .* not now"),
    ]
    for args, message in cases:
        with pytest.raises(TlsError, match=message):
            SiteTls.load(*args)

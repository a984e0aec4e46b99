"""Certificates replaced and revoked while sites run (issue 38), over real gRPC.

A site's files are read again when they change: a new certificate serves new
connections and dials without a restart; a certificate the job's CA revokes
(``isthmus certs --revoke``, the list ``tls.crl`` names) is refused at its
holder's next call."""

from __future__ import annotations

import asyncio
import logging
import shutil

import pytest
import torch
from test_cli import in_process

from isthmus.deploy.render.certs import make_certs, revoke_site
from isthmus.inter.chunks import encode_chunks
from isthmus.inter.codecs import parse_codec
from isthmus.inter.peer import Identity, PeerError, PeerServer
from isthmus.inter.peer_client import PeerClient
from isthmus.inter.tls import SiteTls, TlsError
from isthmus.inter.transport import TransportSettings

SITES = ("a", "b")
A = Identity(job="j", site="a", rank=0, layout_fingerprint="L")
B = Identity(job="j", site="b", rank=0, layout_fingerprint="L")


def _site_files(certs, site, into):
    """A site's own copy of its files, as it would hold them on its machine."""
    into.mkdir(parents=True, exist_ok=True)
    for name in ("ca.crt", f"{site}.crt", f"{site}.key"):
        shutil.copy(certs / name, into / name)
    return into / "ca.crt", into / f"{site}.crt", into / f"{site}.key"


def _chunks(round=0):
    return encode_chunks(
        parse_codec("none"), torch.arange(8.0), round=round, shard=0, max_chunk_bytes=1024
    )


def test_a_certificate_revoked_while_the_job_runs_is_refused_at_its_next_call(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="isthmus.inter.peer")
    certs = tmp_path / "certs"
    make_certs("j", SITES, certs)
    stolen = _site_files(certs, "b", tmp_path / "stolen")  # b's files, copied before
    crl = certs / "revoked.crl"

    async def main():
        crl.write_bytes(_empty_crl(certs))  # the job starts with nothing revoked
        server_tls = SiteTls.load("j", "a", *_site_files(certs, "a", tmp_path / "a"), crl=crl)
        server = PeerServer(A, SITES, lambda c: None, settings=TransportSettings(tls=server_tls))
        port = await server.start("127.0.0.1", 0)
        thief = PeerClient(
            B,
            f"127.0.0.1:{port}",
            settings=TransportSettings(tls=SiteTls.load("j", "b", *stolen)),
            deadline_s=5,
            peer_site="a",
        )
        try:
            await thief.hello()  # not revoked yet: admitted
            revoke_site("j", "b", certs)  # the operator revokes it; nobody restarts
            with pytest.raises(PeerError, match="revoked"):
                await thief.exchange(_chunks())
            with pytest.raises(PeerError, match="revoked"):
                await thief.hello()
            # b's new certificate (from --revoke) is let in.
            fresh = SiteTls.load("j", "b", *_site_files(certs, "b", tmp_path / "b"))
            honest = PeerClient(
                B, f"127.0.0.1:{port}", settings=TransportSettings(tls=fresh), deadline_s=5,
                peer_site="a",
            )  # fmt: skip
            await honest.hello()
            acks = await honest.exchange(_chunks())
            await honest.close()
            return acks, dict(server.servicer.refusals)
        finally:
            await thief.close()
            await server.stop()

    acks, refusals = asyncio.run(main())
    assert all(ack.ok for ack in acks)
    assert refusals == {"REVOKED": 2}
    assert "which the job's CA revoked" in caplog.text


def _empty_crl(certs) -> bytes:
    """A revocation list of the job's CA that revokes nothing."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    ca = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((certs / "ca.key").read_bytes(), None)
    now = datetime.datetime.now(datetime.UTC)
    crl = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.subject)
        .last_update(now)
        .next_update(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    return crl.public_bytes(serialization.Encoding.PEM)


def test_replaced_certificates_are_taken_up_without_a_restart(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="isthmus.inter.tls")
    certs = tmp_path / "certs"
    make_certs("j", SITES, certs)
    a_files = _site_files(certs, "a", tmp_path / "a")
    b_files = _site_files(certs, "b", tmp_path / "b")

    async def main():
        server_tls = SiteTls.load("j", "a", *a_files)
        client_tls = SiteTls.load("j", "b", *b_files)
        server = PeerServer(A, SITES, lambda c: None, settings=TransportSettings(tls=server_tls))
        port = await server.start("127.0.0.1", 0)
        client = PeerClient(
            B, f"127.0.0.1:{port}", settings=TransportSettings(tls=client_tls), deadline_s=5,
            peer_site="a",
        )  # fmt: skip
        try:
            await client.hello()
            before = client.channel
            # Both sites get new certificates (the old ones are about to expire): the
            # operator copies the new files over the old, and nobody restarts.
            for site in SITES:
                (certs / f"{site}.crt").unlink()
                (certs / f"{site}.key").unlink()
            make_certs("j", SITES, certs)
            _site_files(certs, "a", tmp_path / "a")
            _site_files(certs, "b", tmp_path / "b")
            assert server_tls.current()[1] == (certs / "a.crt").read_bytes()
            acks = await client.exchange(_chunks())  # redials with b's new certificate
            redialled = client.channel is not before
            # A stranger dialling now meets a's new certificate.
            late = PeerClient(
                B, f"127.0.0.1:{port}",
                settings=TransportSettings(tls=SiteTls.load("j", "b", *b_files)),
                deadline_s=5, peer_site="a",
            )  # fmt: skip
            await late.hello()
            await late.close()
            return acks, redialled
        finally:
            await client.close()
            await server.stop()

    acks, redialled = asyncio.run(main())
    assert all(ack.ok for ack in acks) and redialled
    assert "took up new certificate files for site 'a'" in caplog.text
    assert "took up new certificate files for site 'b'" in caplog.text


def test_a_bad_replacement_is_refused_and_the_files_in_force_kept(tmp_path, caplog):
    certs = tmp_path / "certs"
    make_certs("j", SITES, certs)
    files = _site_files(certs, "a", tmp_path / "a")
    tls = SiteTls.load("j", "a", *files)
    good = tls.current()
    shutil.copy(certs / "b.crt", files[1])  # someone copies b's certificate over a's
    assert tls.current() == good
    assert "not site 'a' of job 'j''s certificate" in caplog.text


def test_revocation_lists_that_cannot_be_used_are_refused_naming_the_field(tmp_path):
    certs, other = tmp_path / "certs", tmp_path / "other"
    make_certs("j", SITES, certs)
    make_certs("j", SITES, other)  # the same job's name, another CA
    revoke_site("j", "b", other)
    files = (certs / "ca.crt", certs / "a.crt", certs / "a.key")
    with pytest.raises(TlsError, match=r"tls\.crl: cannot read .*nope\.crl.*--revoke SITE"):
        SiteTls.load("j", "a", *files, crl=tmp_path / "nope.crl")
    (tmp_path / "junk.crl").write_text("not a list")
    with pytest.raises(TlsError, match=r"tls\.crl: .*holds no readable revocation list"):
        SiteTls.load("j", "a", *files, crl=tmp_path / "junk.crl")
    with pytest.raises(TlsError, match=r"tls\.crl: .*not signed by the job's CA"):
        SiteTls.load("j", "a", *files, crl=other / "revoked.crl")


def test_certs_revoke_names_the_site_and_what_to_copy(tmp_path, capsys):
    from cryptography import x509

    job = tmp_path / "job.yaml"
    job.write_text("name: j\nsites: [{name: a}, {name: b}]\n")
    out = tmp_path / "certs"
    assert in_process(capsys, "certs", str(job), "--out", str(out))[0] == 0
    old = x509.load_pem_x509_certificate((out / "b.crt").read_bytes()).serial_number
    code, stdout, stderr = in_process(capsys, "certs", str(job), "--out", str(out), "--revoke", "b")
    assert code == 0, stderr
    assert f"serial {old:x}" in stdout and "crl: certs/revoked.crl" in stdout
    revoked = x509.load_pem_x509_crl((out / "revoked.crl").read_bytes())
    assert [e.serial_number for e in revoked] == [old]
    assert x509.load_pem_x509_certificate((out / "b.crt").read_bytes()).serial_number != old
    code, _, stderr = in_process(capsys, "certs", str(job), "--out", str(out), "--revoke", "zz")
    assert code == 2 and "--revoke: 'zz' is not a site of job 'j' (a, b)" in stderr


def test_a_job_file_names_its_revocation_list(tmp_path):
    from isthmus.job.file import JobFileError, parse_job

    base = (
        "name: j\nsites: [{name: a}]\ntls: {ca: c/ca.crt, cert: 'c/{site}.crt', key: 'c/{site}.key'"
    )
    job = parse_job(base + ", crl: c/revoked.crl}\n", check_files=False)
    assert job.tls is not None and job.tls.crl_path is not None
    assert job.tls.crl_path.name == "revoked.crl"
    with pytest.raises(JobFileError, match=r"tls\.crl: must be the path"):
        parse_job(base + ", crl: 'c/{site}.crl'}\n", check_files=False)


def test_a_site_whose_own_certificate_is_revoked_is_stopped_at_start(tmp_path):
    certs = tmp_path / "certs"
    make_certs("j", SITES, certs)
    old = _site_files(certs, "b", tmp_path / "old-b")
    revoke_site("j", "b", certs)
    with pytest.raises(TlsError, match=r"tls\.cert: .*is revoked by the job's list"):
        SiteTls.load("j", "b", *old, crl=certs / "revoked.crl")
    SiteTls.load(
        "j", "b", certs / "ca.crt", certs / "b.crt", certs / "b.key", crl=certs / "revoked.crl"
    )


def test_isthmus_check_checks_the_certificates_on_this_machine(tmp_path, capsys):
    certs = tmp_path / "certs"
    make_certs("j", SITES, certs, days=10)
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: j\nsites: [{name: a}, {name: b}]\n"
        "tls: {ca: certs/ca.crt, cert: 'certs/{site}.crt', key: 'certs/{site}.key'}\n"
    )
    (certs / "b.crt").unlink()
    (certs / "b.key").unlink()  # b's files live on b's machine
    code, stdout, stderr = in_process(capsys, "check", str(job))
    assert code == 0, stderr
    assert "tls a: certificate valid until" in stdout
    assert "site a's certificate ends in" in stdout  # 10 days: time to replace it
    assert "tls b: files not on this machine" in stdout
    shutil.copy(certs / "a.crt", certs / "b.crt")
    shutil.copy(certs / "a.key", certs / "b.key")  # a's certificate where b's should be
    code, _, stderr = in_process(capsys, "check", str(job))
    assert code == 2 and "site b: tls.cert:" in stderr and "not site 'b'" in stderr

"""Resolving listen and dial addresses from the job file or from a running emulator."""

from __future__ import annotations

import pytest

from isthmus.job.addressing import AddressError, load_state, resolve
from isthmus.job.file import parse_job

JOB = """\
name: addr
sites:
  - {name: a, ranks: 2, address: '0.0.0.0:7100', advertise: '203.0.113.7:9100'}
  - {name: b, ranks: 1, address: '10.1.2.3:7200'}
"""


def test_without_emulation_peers_dial_the_advertised_address_plus_rank():
    job = parse_job(JOB)
    a = resolve(job, "a")
    assert a.listen == [("0.0.0.0", 7100), ("0.0.0.0", 7101)]
    assert a.peers == {"b": [("10.1.2.3", 7200)]}
    b = resolve(job, "b")
    assert b.peers == {"a": [("203.0.113.7", 9100), ("203.0.113.7", 9101)]}


def test_without_emulation_a_site_without_address_is_named():
    job = parse_job("name: x\nsites: [{name: a, address: '1.2.3.4:5'}, {name: b}]\n")
    with pytest.raises(AddressError, match=r"sites\[1\]\.address: site 'a' cannot reach 'b'"):
        resolve(job, "a")
    with pytest.raises(AddressError, match=r"sites\[1\]\.address: site 'b' needs an address"):
        resolve(job, "b")


def test_with_emulation_the_state_file_decides(tmp_path):
    job = parse_job(JOB)
    state = {
        "job": "addr",
        "sites": {
            "a": {
                "listen": ["127.0.0.1:7100", "127.0.0.1:7101"],
                "dial": {"b": ["127.0.0.1:4000"]},
            },
            "b": {
                "listen": ["127.0.0.1:7200"],
                "dial": {"a": ["127.0.0.1:4001", "127.0.0.1:4002"]},
            },
        },
    }
    b = resolve(job, "b", state)
    assert b.listen == [("127.0.0.1", 7200)]
    assert b.peers == {"a": [("127.0.0.1", 4001), ("127.0.0.1", 4002)]}
    with pytest.raises(AddressError, match="state is for job 'other'"):
        resolve(job, "a", {**state, "job": "other"})


def test_bad_state_files_are_named(tmp_path):
    with pytest.raises(AddressError, match="no such state file"):
        load_state(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(AddressError, match="not JSON"):
        load_state(bad)

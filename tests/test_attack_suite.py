"""The attack suite's broker case (benchmarks/attack_suite.py), against a real Mosquitto.

The data-plane cases have their own tests over real gRPC: a plaintext client and
another job's certificate (test_tls), a certificate claiming another site
(test_tls), a revoked certificate (test_tls_rotation), a replayed chunk
(test_allreduce), an oversized message and a stream flood (test_limits). This
one runs the suite's own broker case: Mosquitto configured as ``isthmus deploy
render`` writes it, a client without a certificate and a site's client trying
to publish live settings, an honest site listening, the operator as control.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from needs import needs_mosquitto

from isthmus.deploy.render.certs import make_certs

SUITE = Path(__file__).resolve().parent.parent / "benchmarks" / "attack_suite.py"


@pytest.mark.slow  # a real Mosquitto and 2 s waits for refused connections
@needs_mosquitto
def test_only_the_operators_certificate_publishes_live_settings(tmp_path):
    spec = importlib.util.spec_from_file_location("attack_suite", SUITE)
    assert spec is not None and spec.loader is not None
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    certs = tmp_path / "certs"
    make_certs(suite.JOB, suite.SITES, certs, broker=["127.0.0.1"])
    case = suite.broker_settings(tmp_path, {"certs": certs}, n=3)
    assert case["refused_as_the_attacker_saw"] == 3  # no certificate: no connection
    assert case["settings_reaching_a_site"] == 0  # a site's certificate: the ACL drops it
    assert case["denied_publish_lines_in_the_broker_log"] == 3
    assert case["operators_settings_arrived (the control)"]
    assert case["held"]

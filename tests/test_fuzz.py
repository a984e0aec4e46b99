"""Fuzzing the job-file parser and the peer's chunk handler (a small budget here;
``benchmarks/fuzz.py`` runs them for a fixed time and prints crashes and hangs)."""

from __future__ import annotations

from fuzzing import JOB_TEXTS, chunk_messages, chunk_target, job_file_target
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# The same inputs on every run (derandomized): a test run must not fail by
# chance. benchmarks/fuzz.py explores new inputs.
BUDGET = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@BUDGET
@given(JOB_TEXTS)
def test_the_job_file_parser_only_ever_refuses_with_a_message(text):
    job_file_target(text)


@BUDGET
@given(chunk_messages(), st.one_of(st.none(), st.integers(0, 5000)))
def test_a_peer_answers_every_chunk_with_an_acknowledgement(chunk, buffer_values):
    chunk_target(chunk, buffer_values)

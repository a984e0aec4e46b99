"""Inputs for fuzzing (hypothesis strategies) and the targets they are fed to.

Two targets, both fed what an attacker or a careless user controls:

* the job-file parser: random documents over the real keys, random text, and
  mutations of the example job files (a leaf replaced by a random value). Only
  a :class:`JobFileError` (one line per problem, naming the field) may come out;
* a peer's chunk handler (``PeerServicer.accept`` into the engine's receive
  buffers): chunk messages with random fields and payloads, their checksum
  right or wrong. Only an acknowledgement (accepted, or refused with a code)
  may come out.

Used by ``tests/test_fuzz.py`` (a small budget) and ``benchmarks/fuzz.py``
(a fixed time budget, printing crashes and hangs).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from isthmus.inter.allreduce import Incoming
from isthmus.inter.chunks import checksum
from isthmus.inter.peer import Identity, PeerServicer
from isthmus.job.file import (
    CONTROL_KEYS,
    FAULT_KEYS,
    SITE_KEYS,
    TLS_KEYS,
    TOP_LEVEL_KEYS,
    WAN_KEYS,
    JobFileError,
    parse_job,
)
from isthmus.job.settings import SETTING_NAMES
from isthmus.proto import wire_pb2
from isthmus.sim.tuner import TUNE_KEYS

EXAMPLES = Path(__file__).resolve().parents[1] / "deploy" / "examples"
KEYS = sorted(
    {
        *TOP_LEVEL_KEYS,
        *CONTROL_KEYS,
        *TLS_KEYS,
        *SITE_KEYS,
        *WAN_KEYS,
        *FAULT_KEYS,
        *SETTING_NAMES,
        *TUNE_KEYS,
        "between",
        "rtt_ms",
        "bandwidth_mbit",
        "loss",
        "preset",
        "egress",
        "dp_shard",
        "tp",
        "pp",
    }
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=24),
    st.sampled_from(
        ["127.0.0.1:7100", "[::1]:0", "a:b", "diloco", "int4", "{site}", "../x", "mqtts://h:1"]
    ),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), inner, max_size=5),
    ),
    max_leaves=30,
)


def _examples() -> list[dict[str, Any]]:
    return [yaml.safe_load(p.read_text()) for p in sorted(EXAMPLES.glob("*.yaml"))]


@st.composite
def _mutated_example(draw: st.DrawFn) -> str:
    doc = draw(st.sampled_from(_examples()))
    leaves = list(_leaf_paths(doc))
    path = draw(st.sampled_from(leaves))
    _set(doc, path, draw(VALUES))
    return yaml.safe_dump(doc)


def _leaf_paths(node: Any, path: tuple = ()) -> Any:
    yield path
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaf_paths(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _leaf_paths(value, (*path, i))


def _set(doc: Any, path: tuple, value: Any) -> None:
    if not path:
        return
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


JOB_TEXTS = st.one_of(
    st.dictionaries(st.sampled_from(TOP_LEVEL_KEYS), VALUES, max_size=9).map(yaml.safe_dump),
    _mutated_example(),
    st.text(max_size=400),
)


def job_file_target(text: str) -> None:
    """Parse ``text`` as a job file; anything but success or JobFileError propagates."""
    try:
        parse_job(text, source="fuzz.yaml")
    except JobFileError as exc:
        assert exc.lines(), "a refusal says why"


CODECS = st.one_of(
    st.sampled_from(["none", "fp16", "bf16", "int8", "int4", "int8+zstd", "int4+zstd", ""]),
    st.text(max_size=12),
)
U32, U64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
SMALL = st.integers(0, 4096)


@st.composite
def chunk_messages(draw: st.DrawFn) -> wire_pb2.Chunk:
    payload = draw(st.binary(max_size=4096))
    sizes = st.one_of(SMALL, U64)
    chunk = wire_pb2.Chunk(
        round=draw(st.one_of(SMALL, U64)),
        shard=draw(st.one_of(st.integers(0, 8), U32)),
        index=draw(st.one_of(st.integers(0, 8), U32)),
        count=draw(st.one_of(st.integers(0, 8), U32)),
        codec=draw(CODECS),
        elements=draw(sizes),
        dtype=draw(st.sampled_from(["float32", "float16", ""])),
        payload=payload,
        block_size=draw(st.one_of(st.sampled_from([0, 1, 64, 256]), U32)),
        scales_bytes=draw(sizes),
        values_bytes=draw(sizes),
        element_bytes=draw(st.one_of(st.sampled_from([0, 1, 2, 4]), U32)),
        weight=draw(st.floats(allow_nan=True, allow_infinity=True)),
        offset=draw(sizes),
        lane=draw(st.one_of(st.integers(0, 4), U32)),
    )
    # Mostly a right checksum: otherwise nothing past the first check is reached.
    chunk.checksum = checksum(chunk, payload) if draw(st.integers(0, 9)) else draw(U32)
    return chunk


def chunk_target(chunk: wire_pb2.Chunk, buffer_values: int | None) -> wire_pb2.Ack:
    """Hand ``chunk`` to a peer service whose engine waits for ``buffer_values``
    values from the sender (None: not yet in the round, so the chunk waits)."""
    incoming = Incoming()
    if buffer_values is not None:
        incoming.open(buffer_values)
    me = Identity(job="fuzz", site="a", rank=0)
    servicer = PeerServicer(me, ["a", "b"], incoming.add)
    ack = asyncio.run(servicer.accept(chunk, "b", 0, "ipv4:198.51.100.7:5000"))
    assert isinstance(ack, wire_pb2.Ack)
    return ack

"""The job file: one YAML document that describes a multi-site training job.

It is read once, validated completely, and every problem is reported together,
each as ``FILE:LINE: field.path: what is wrong (the fix)``. Nothing starts
from a job file with an error. The schema is documented in docs/job-file.md.

Shape (every section but ``name`` and ``sites`` is optional)::

    name: demo
    seed: 0
    sites:
      - {name: us-east, ranks: 2, address: 127.0.0.1:7100, advertise: 203.0.113.7:7100}
      - {name: eu-west, ranks: 1, uplink_mbit: 400}
    wan:
      default: {rtt_ms: 80, bandwidth_mbit: 1000}        # or {preset: transatlantic}
      links:
        - {between: [us-east, eu-west], rtt_ms: 75, jitter_ms: 2, loss: 0.001}
      faults:
        - {at_s: 30, link: [us-east, eu-west], action: partition, for_s: 10}
        - {at_round: 4, link: [us-east, eu-west], action: partition, for_rounds: 2}
    train: {strategy: diloco, steps: 600, sync_every: 50, codec: int8}
    control: {broker: mqtt://broker.example:1883}     # else an embedded broker
    tune: {target_utilization: 0.9, codecs: [none, int8], online: true}   # isthmus tune
    model: tiny            # a built-in size, or package.module:function
    data: stdlib           # the built-in corpus, a text or .pt file, or package.module:function
"""

from isthmus.job.addressing import parse_address
from isthmus.job.file.loading import load_job, load_yaml, parse_job
from isthmus.job.file.validate import (
    CONTROL_KEYS,
    FAULT_KEYS,
    NAME_PATTERN,
    SITE_KEYS,
    TLS_KEYS,
    TOP_LEVEL_KEYS,
    WAN_KEYS,
    JobFileError,
)
from isthmus.job.model import ControlSpec, Job, SiteSpec, TlsSpec, WanSpec
from isthmus.job.ports import free_port_blocks

# The job's dataclasses are the job model's (isthmus.job.model) and ports are picked
# by isthmus.job.ports; the names stay importable from here.
__all__ = [
    "CONTROL_KEYS",
    "FAULT_KEYS",
    "NAME_PATTERN",
    "SITE_KEYS",
    "TLS_KEYS",
    "TOP_LEVEL_KEYS",
    "WAN_KEYS",
    "ControlSpec",
    "Job",
    "JobFileError",
    "SiteSpec",
    "TlsSpec",
    "WanSpec",
    "free_port_blocks",
    "load_job",
    "load_yaml",
    "parse_address",
    "parse_job",
]

"""Job-file validation: every accepted shape, and every error naming its field, line and fix."""

import textwrap
from pathlib import Path

import pytest

from isthmus.job.file import JobFileError, load_job, parse_address, parse_job
from isthmus.sim.topology import Topology

ISSUE_EXAMPLE = """\
name: demo
sites:
  - name: us-east
    ranks: 2
    address: 127.0.0.1:7100   # optional: where rank 0's peer service listens; rank r uses port+r
    advertise: 203.0.113.7:7100   # optional: the address peers dial (NAT, load balancer)
  - name: eu-west
    ranks: 1
    uplink_mbit: 400          # optional: cap on the site's total WAN egress and ingress
wan:                          # optional: emulated links; omit on a real WAN
  default: {rtt_ms: 80, bandwidth_mbit: 1000}
  links:
    - {between: [us-east, eu-west], rtt_ms: 75, bandwidth_mbit: 500, jitter_ms: 2, loss: 0.001}
  faults:                     # optional: a schedule, seconds from start
    - {at_s: 30, link: [us-east, eu-west], action: partition, for_s: 10}
train:
  strategy: diloco            # sync | diloco | streaming | async
  steps: 600                  # inner steps per site
  sync_every: 50
  outer_lr: 0.7
  outer_momentum: 0.9
  codec: int8
"""


def _errors(text: str) -> list[str]:
    with pytest.raises(JobFileError) as info:
        parse_job(textwrap.dedent(text), source="job.yaml")
    return info.value.lines()


def test_the_issue_example_is_accepted():
    job = parse_job(ISSUE_EXAMPLE)
    assert job.name == "demo"
    east, west = job.sites
    assert east.ranks == 2 and east.listen_addresses() == [("127.0.0.1", 7100), ("127.0.0.1", 7101)]
    assert east.dial_addresses() == [("203.0.113.7", 7100), ("203.0.113.7", 7101)]
    assert west.uplink_mbit == 400 and west.dial_addresses() is None
    assert job.train.strategy == "diloco" and job.train.codec == "int8" and job.train.steps == 600
    (fault,) = job.wan.faults
    assert (fault.at_s, fault.link, fault.action, fault.for_s) == (
        30,
        ("us-east", "eu-west"),
        "partition",
        10,
    )
    topo = Topology.for_job(
        job, {"us-east": [("127.0.0.1", 1), ("127.0.0.1", 2)], "eu-west": [("127.0.0.1", 3)]}
    )
    link = topo.link_params("eu-west", "us-east")
    assert link.rtt_ms == 75 and link.a_to_b.bandwidth_mbit == 500 and link.a_to_b.jitter_ms == 2


def test_a_fault_may_start_and_end_at_rounds_and_at_s_still_works():
    job = parse_job(
        "name: x\nsites: [{name: a}, {name: b}, {name: c}]\nwan:\n  faults:\n"
        "    - {at_round: 4, rounds_of: b, link: [a, c], action: partition, for_rounds: 3}\n"
        "    - {at_round: 2, link: [a, b], action: partition, for_s: 8, mode: reset}\n"
        "    - {at_s: 20, link: [b, c], action: flap, for_rounds: 2, period_s: 2, down_s: 1}\n"
    )
    first, second, third = job.wan.faults
    assert (first.at_s, first.at_round, first.rounds_of, first.for_rounds) == (None, 4, "b", 3)
    assert (first.describe_start(), first.describe_length()) == (
        "round 4 of b",
        "for 3 rounds of b",
    )
    assert (second.at_round, second.rounds_of, second.for_s) == (2, None, 8)
    assert (second.describe_start(), second.describe_length()) == ("round 2", "for 8 s")
    assert (third.at_s, third.at_round, third.for_rounds) == (20, None, 2)
    assert third.describe_start() == "20 s"


def test_minimal_job_gets_defaults():
    job = parse_job("name: x\nsites: [{name: a}, {name: b}]\n")
    assert [s.ranks for s in job.sites] == [1, 1]
    assert job.wan is None
    assert job.train.strategy == "diloco" and job.train.sync_every == 50


def test_a_codec_may_carry_the_zstd_stage():
    job = parse_job(
        "name: x\nsites: [{name: a}]\ntrain: {codec: int2+zstd, error_feedback: true}\n"
    )
    assert job.train.codec == "int2+zstd"


def test_default_link_applies_to_every_pair_and_presets_resolve():
    job = parse_job(
        "name: x\nsites: [{name: a}, {name: b}, {name: c}]\n"
        "wan:\n  default: {preset: transatlantic, loss: 0.01}\n"
        "  links: [{between: [a, c], preset: transpacific}]\n"
    )
    topo = Topology.for_job(job, {n: [("h", 1)] for n in "abc"})
    assert (
        topo.link_params("a", "b").rtt_ms == 80 and topo.link_params("a", "b").a_to_b.loss == 0.01
    )
    assert topo.link_params("b", "c").rtt_ms == 80
    assert topo.link_params("c", "a").rtt_ms == 105


def test_numbers_in_exponent_form_without_a_dot_are_numbers():
    # YAML 1.1 (PyYAML) would read 2e-6 as a string; people mean a number.
    job = parse_job(
        "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  default: {corrupt: 2e-6, loss: 1E-3}\n"
    )
    params = Topology.for_job(job, {n: [("h", 1)] for n in "ab"}).link_params("a", "b").a_to_b
    assert params.corrupt == 2e-6 and params.loss == 1e-3


def test_egress_overrides_one_direction():
    job = parse_job(
        "name: x\nsites: [{name: a}, {name: b}]\n"
        "wan:\n  links:\n    - between: [a, b]\n      rtt_ms: 40\n"
        "      egress: {b: {bandwidth_mbit: 10}}\n"
    )
    link = Topology.for_job(job, {"a": [("h", 1)], "b": [("h", 2)]}).link_params("a", "b")
    assert link.a_to_b.bandwidth_mbit is None
    assert link.b_to_a.bandwidth_mbit == 10
    assert link.a_to_b.delay_ms == link.b_to_a.delay_ms == 20


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "name: x\nsites: [{name: a, ranks: 0}]\n",
            "job.yaml:2: sites[0].ranks: must be an integer >= 1",
        ),
        ("name: x\nsites: [{name: a}, {name: a}]\n", "sites[1].name: duplicate site name 'a'"),
        (
            "name: x\nsites:\n  - name: a\n    uplnk_mbit: 3\n",
            "job.yaml:4: sites[0].uplnk_mbit: unknown key; did you mean 'uplink_mbit'?",
        ),
        ("name: x\nsites: [{name: a, address: 'nope'}]\n", "sites[0].address: must be 'host:port'"),
        ("name: x\nsites: [{name: a, address: '1.2.3.4:70000'}]\n", "port must be in 1..65535"),
        (
            "name: x\nsites: [{name: a, uplink_mbit: -4}]\n",
            "sites[0].uplink_mbit: must be a positive number",
        ),
        ("name: 'has space'\nsites: [{name: a}]\n", "job.yaml:1: name: must be 1-63 letters"),
        ("sites: [{name: a}]\n", "missing 'name'"),
        ("name: x\n", "missing 'sites'"),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  default: {rtt_ms: -80}\n",
            "job.yaml:4: wan.default.rtt_ms: must be a number >= 0, got -80",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  default: {loss: 1.5}\n",
            "wan.default.loss: must be a fraction in [0, 1]",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  links: [{between: [a, asia]}]\n",
            "wan.links[0].between: unknown site 'asia'",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  links: [{between: [a, a]}]\n",
            "a link joins two different sites",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  links: [{between: [a, b]}, {between: [b, a]}]\n",
            "is listed twice",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  default: {preset: mars}\n",
            "wan.default.preset: unknown preset 'mars'",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  faults: [{at_s: 1, link: [a, b], action: explode}]\n",
            "wan.faults[0].action: unknown fault 'explode'",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  faults: [{at_s: 1, link: [a, b], action: flap, for_s: 5}]\n",
            "wan.faults[0].period_s: a flap needs period_s",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  faults: [{at_s: 1, link: [a, b], action: brownout, changes: {loss: 3}}]\n",
            "wan.faults[0].changes.loss: must be a fraction",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  faults: [{link: [a, b], action: partition}]\n",
            "wan.faults[0]: missing 'at_s or at_round'",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  faults: [{at_s: 1, at_round: 2, link: [a, b], action: partition}]\n",
            "wan.faults[0].at_s: give one of at_s (seconds after the emulator started) or at_round",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  faults: [{at_round: 0, link: [a, b], action: partition}]\n",
            "wan.faults[0].at_round: must be a whole number of rounds >= 1, got 0 (round 1 is the first",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  faults: [{at_round: 2.5, link: [a, b], action: partition}]\n",
            "wan.faults[0].at_round: must be a whole number of rounds >= 1, got 2.5",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  faults: [{at_round: 2, link: [a, b], action: partition, for_s: 3, for_rounds: 2}]\n",
            "wan.faults[0].for_rounds: give one of for_s (seconds) or for_rounds (rounds), not both",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  faults: [{at_round: 2, link: [a, b], action: partition, for_rounds: -1}]\n",
            "wan.faults[0].for_rounds: must be a whole number of rounds >= 1",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  faults: [{at_round: 2, rounds_of: c, link: [a, b], action: partition}]\n",
            "wan.faults[0].rounds_of: unknown site 'c'; sites: a, b",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  faults: [{at_s: 2, rounds_of: a, link: [a, b], action: partition, for_s: 1}]\n",
            "wan.faults[0].rounds_of: names whose rounds at_round or for_rounds count",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  faults: [{at_round: 2, rounds_of: [a], link: [a, b], action: partition}]\n",
            "wan.faults[0].rounds_of: must be a site's name",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  faults: [{at_round: 2, link: [a, b], action: flap, period_s: 2, down_s: 1}]\n",
            "wan.faults[0].for_s: a flap needs for_s or for_rounds",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {strategy: dilco}\n",
            "train.strategy: unknown strategy 'dilco'",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {sync_every: 0}\n",
            "train.sync_every: must be an integer >= 1",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {eval_every: -5}\n",
            "train.eval_every: must be an integer >= 0 (inner steps; 0: only at the end",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {strategy: streaming, merge: lazy}\n",
            "train.merge: unknown merge 'lazy'; use one of mix, eager",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {sync_evry: 3}\n",
            "train.sync_evry: unknown key; did you mean 'sync_every'?",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {codec: int3}\n",
            "train.codec: unknown codec 'int3'",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {codec: int4+lz4}\n",
            "optionally followed by +zstd (e.g. int2+zstd)",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {strategy: async, round_seconds: 30}\n",
            "train.round_seconds: time-budgeted rounds are a diloco setting",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {round_seconds: -1}\n",
            "train.round_seconds: must be a number of seconds > 0",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {error_feedback: 1}\n",
            "train.error_feedback: must be true or false",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {strategy: async, late_contributions: keep}\n",
            "train.late_contributions: unknown policy 'keep'; use drop",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {late_contributions: stale}\n",
            "train.late_contributions: late contributions are an async setting",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {strategy: async, staleness_weight: 0}\n",
            "train.staleness_weight: must be a number in (0, 1], got 0",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {grad_clip: -1}\n",
            "train.grad_clip: must be a gradient norm >= 0 (0: no clipping), got -1",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {lr_schedule: linear}\n",
            "train.lr_schedule: unknown schedule 'linear'; use one of cosine, constant, wsd",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {inner_beta2: 1}\n",
            "train.inner_beta2: must be in [0, 1), got 1",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {inner_optimizer: lamb}\n",
            "train.inner_optimizer: unknown inner optimizer 'lamb'; use one of adamw, site_adamw",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {inner_weight_decay: -0.1}\n",
            "train.inner_weight_decay: must be a number >= 0, got -0.1",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {round_deadline_s: 30}\n",
            "train.collective_timeout_s: 60 s must be shorter than round_deadline_s (30 s)",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {round_deadline_s: 900}\n",
            "train.rejoin_timeout_s: 600 s must be longer than round_deadline_s (900 s)",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {collective_timeout_s: 0}\n",
            "train.collective_timeout_s: must be a number of seconds > 0",
        ),
        (
            "name: x\nsites: [{name: a}]\ntrain: {round_seconds: 30}\ntune: {online: true}\n",
            "tune.online: rounds are time-budgeted",
        ),
        (
            "name: x\nsites: [{name: a}]\ntls: {ca: certs/ca.crt, cert: 'certs/{site}.crt'}\n",
            "tls.key: missing or not a path",
        ),
        # Found by fuzzing (benchmarks/fuzz.py): each crashed or hung the parser.
        ("name: x\nsites: [{name: a}]\nnull: 1\n", "None: unknown key"),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  default: {preset: []}\n",
            "wan.default.preset: unknown preset []",
        ),
        (
            "name: x\nsites: [{name: a}, {name: b}]\nwan:\n  faults: [{at_s: null, link: [a, b], action: partition}]\n",
            "wan.faults[0].at_s: must be a number of seconds",
        ),
        ("name: x\nsites: [{name: a}]\ntune: {codecs: [{}]}\n", "tune.codecs: list some of"),
        ("name: x\nsites: [{name: a}]\ntune: {codecs: null}\n", "tune.codecs: list some of"),
        ('name: x\nsites: [{name: a}]\ndata: "a\\0b"\n', "data: must be 'stdlib'"),
        ("name: x\nsites: [{name: a}]\nextra: 1\n", "extra: unknown key"),
        (
            "name: x\nsites:\n  - {name: a, address: '127.0.0.1:7100', ranks: 2}\n  - {name: b, address: '127.0.0.1:7101'}\n",
            "127.0.0.1:7101 is also used by site 'a'",
        ),
        (
            "name: x\nsites: [{name: a, address: '127.0.0.1:65535', ranks: 2}]\n",
            "need ports up to 65536",
        ),
        ("- just\n- a list\n", "the job file must be a mapping"),
        ("name: x\nsites: [unclosed\n", "not valid YAML"),
        ("", "the file is empty"),
    ],
)
def test_bad_input_names_the_field(text, expected):
    errors = _errors(text)
    assert any(expected in line for line in errors), errors


def test_every_problem_is_reported_at_once():
    errors = _errors(
        "name: x\nsites: [{name: a, ranks: -1}, {name: b}]\n"
        "wan:\n  default: {rtt_ms: -1, loss: 7}\ntrain: {steps: 0}\n"
    )
    assert len(errors) >= 3
    assert any("sites[0].ranks" in e for e in errors)
    assert any("wan.default" in e for e in errors)
    assert any("train.steps" in e for e in errors)


def test_a_site_with_an_error_is_not_reported_again_as_unknown_in_links():
    errors = _errors(
        "name: x\nsites: [{name: a, ranks: 0}, {name: b}]\nwan:\n  links: [{between: [a, b]}]\n"
    )
    assert not any("unknown site" in e for e in errors), errors


def test_missing_file_is_named(tmp_path):
    with pytest.raises(JobFileError, match=r"nope\.yaml: file not found"):
        load_job(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:7100", ("127.0.0.1", 7100)),
        ("[::1]:7100", ("::1", 7100)),
        ("host.example:1", ("host.example", 1)),
    ],
)
def test_addresses_parse(text, expected):
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["7100", "host:", ":7100", "::1:7100", "a b:1", 7100])
def test_bad_addresses_get_a_message(text):
    assert isinstance(parse_address(text), str)


EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "deploy" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_shipped_examples_are_valid(path):
    job = load_job(path)
    assert len(job.sites) >= 2 and job.wan is not None


def test_a_fault_built_in_python_needs_one_start_and_one_end():
    from isthmus.job.link import LinkConfigError
    from isthmus.sim.topology import Fault, validate_fault

    with pytest.raises(LinkConfigError, match=r"give at_s \(seconds after the emulator started\)"):
        validate_fault(Fault(link=("a", "b"), action="partition"), ["a", "b"])
    with pytest.raises(LinkConfigError, match="not both"):
        validate_fault(
            Fault(at_round=1, link=("a", "b"), action="corrupt", rate=0.1, for_s=1, for_rounds=1),
            ["a", "b"],
        )
    with pytest.raises(LinkConfigError, match="whole number of rounds"):
        validate_fault(Fault(at_round=True, link=("a", "b"), action="partition"), ["a", "b"])


LONG_FAT = """\
name: long-fat
sites:
  - {name: a}
  - {name: b}
  - {name: c}
wan:
  default: {rtt_ms: 20, bandwidth_mbit: 1000}
  links:
    - {between: [a, b], rtt_ms: 300, bandwidth_mbit: 1000}
train: {strategy: diloco, steps: 10, sync_every: 5CONNECTIONS}
"""


def test_connections_per_peer_auto_fills_each_site_s_longest_fat_link():
    """1 Gbit/s at 300 ms holds 37.5 MB, the emulator's window is 16 MiB: a and b
    open three connections to each peer; c, whose links are 20 ms long, one. On a
    real WAN (no wan: section) auto is one, and a number given is taken as it is."""
    from isthmus.inter.transport import connections_of

    job = parse_job(LONG_FAT.replace("CONNECTIONS", ""))
    assert job.train.connections_per_peer == "auto"
    assert [connections_of(job, s) for s in "abc"] == [3, 3, 1]
    given = parse_job(LONG_FAT.replace("CONNECTIONS", ", connections_per_peer: 5"))
    assert connections_of(given, "c") == 5
    real = parse_job(LONG_FAT.replace("CONNECTIONS", "").split("wan:")[0] + "train: {}\n")
    assert connections_of(real, "a") == 1


@pytest.mark.parametrize("value", ["0", "17", "many", "true"])
def test_a_bad_connections_per_peer_is_refused_naming_the_field(value):
    (line,) = _errors(LONG_FAT.replace("CONNECTIONS", f", connections_per_peer: {value}"))
    assert "train.connections_per_peer" in line and "auto or an integer in 1..16" in line


def test_isthmus_run_says_when_sites_open_several_connections_and_why():
    from isthmus.deploy.cli.run import _connections_note

    auto = _connections_note(parse_job(LONG_FAT.replace("CONNECTIONS", "")))
    assert auto == (
        "TCP connections to each peer: a 3, b 3 (the links' bandwidth x RTT is more than "
        "one TCP window carries)"
    )
    given = parse_job(LONG_FAT.replace("CONNECTIONS", ", connections_per_peer: 2"))
    assert _connections_note(given).endswith("a 2, b 2, c 2 (train.connections_per_peer)")
    one = parse_job(LONG_FAT.replace("CONNECTIONS", ", connections_per_peer: 1"))
    assert _connections_note(one) == ""  # the usual case says nothing

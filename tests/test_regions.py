"""Regions: sites that share long-haul capacity, in the job file and the emulator's links."""

import textwrap

import pytest

from isthmus.job.file import JobFileError, parse_job
from isthmus.sim.proxy import LinkRuntime
from isthmus.sim.router import PacketLink
from isthmus.sim.topology import Topology

# The shape, with the sites it names.
NINE_SITES = """\
name: regions
sites:
  - {name: oregon}
  - {name: virginia}
  - {name: ohio}
  - {name: frankfurt}
  - {name: dublin}
  - {name: paris}
  - {name: tokyo}
  - {name: seoul}
  - {name: osaka}
regions:
  - {name: us, sites: [oregon, virginia, ohio], egress_mbit: 300}   # shared long-haul capacity, each direction
  - {name: eu, sites: [frankfurt, dublin, paris], egress_mbit: 300}
  - {name: asia, sites: [tokyo, seoul, osaka]}
wan:
  default: {rtt_ms: 8, bandwidth_mbit: 1000}                          # links inside a region
  between_regions: {rtt_ms: 140, bandwidth_mbit: 300}                # default for links across regions
  links:
    - {between: [oregon, tokyo], rtt_ms: 100, bandwidth_mbit: 500}
"""


def _listen(job):
    return {s.name: [("127.0.0.1", 10_000 + i)] for i, s in enumerate(job.sites)}


def test_regions_set_the_default_link_inside_and_across_them():
    job = parse_job(NINE_SITES)
    assert [(r.name, r.sites, r.egress_mbit) for r in job.regions] == [
        ("us", ("oregon", "virginia", "ohio"), 300),
        ("eu", ("frankfurt", "dublin", "paris"), 300),
        ("asia", ("tokyo", "seoul", "osaka"), None),
    ]
    assert job.region_of()["dublin"] == "eu"
    topology = Topology.for_job(job, _listen(job))
    inside = topology.link_params("oregon", "ohio").a_to_b
    across = topology.link_params("virginia", "paris").a_to_b
    override = topology.link_params("tokyo", "oregon").a_to_b
    assert (inside.delay_ms, inside.rate_bytes_per_s) == (4, 1000e6 / 8)
    assert (across.delay_ms, across.rate_bytes_per_s) == (70, 300e6 / 8)
    assert (override.delay_ms, override.rate_bytes_per_s) == (50, 500e6 / 8)
    assert topology.region_egress_mbit == {"us": 300, "eu": 300}


def test_traffic_between_regions_passes_both_regions_shared_limits_on_both_backends():
    job = parse_job(NINE_SITES)
    topology = Topology.for_job(job, _listen(job))
    limits = topology.shared_limits()
    us_out, us_in = limits.regions["us"]
    eu_out, eu_in = limits.regions["eu"]
    assert limits.on_the_way("ohio", "dublin") == [us_out, eu_in]
    assert limits.on_the_way("paris", "oregon") == [eu_out, us_in]
    assert limits.on_the_way("ohio", "tokyo") == [us_out]  # asia has no cap
    assert limits.on_the_way("ohio", "oregon") == []  # inside a region: its own link only
    # The proxy's and the packet router's links take them alike (one model,
    # isthmus.sim.direction, under both backends).
    params = topology.link_params("ohio", "dublin")
    packets = PacketLink("ohio", "dublin", params, seed=0, lock=None, limits=limits)
    proxied = LinkRuntime("ohio", "dublin", params, seed=0, limits=limits, timers=None)
    for link in (packets, proxied):
        assert link.a_to_b.buckets[1:] == [us_out, eu_in]
        assert link.b_to_a.buckets[1:] == [eu_out, us_in]


def test_a_site_uplink_and_its_region_both_apply():
    text = NINE_SITES.replace("{name: ohio}", "{name: ohio, uplink_mbit: 50}")
    job = parse_job(text)
    limits = Topology.for_job(job, _listen(job)).shared_limits()
    ohio_out, _ = limits.sites["ohio"]
    us_out, eu_in = limits.regions["us"][0], limits.regions["eu"][1]
    assert limits.on_the_way("ohio", "dublin") == [ohio_out, us_out, eu_in]


BAD = [
    (
        "regions: [{name: us, sites: [a, bb]}, {name: eu, sites: [c]}]",
        "regions[0].sites: unknown site 'bb'; did you mean 'b'?",
    ),
    (
        "regions: [{name: us, sites: [a, b]}, {name: eu, sites: [b, c]}]",
        "regions[1].sites: site 'b' is already in region 'us' (regions[0]); a site belongs "
        "to one region",
    ),
    (
        "regions: [{name: us, sites: [a, b]}]",
        "regions: site c in no region: once any site is in a region, every site must be",
    ),
    (
        "regions: [{name: us, sites: [a, b], egress_mbit: 0}, {name: eu, sites: [c]}]",
        "regions[0].egress_mbit: must be a positive number of Mbit/s",
    ),
    (
        "regions: [{name: us, sites: [a, b], egress_mbit: -300}, {name: eu, sites: [c]}]",
        "regions[0].egress_mbit: must be a positive number of Mbit/s",
    ),
    (
        "regions: [{name: us, sites: [a]}, {name: us, sites: [b, c]}]",
        "regions[1].name: region 'us' is already regions[0]; merge the two",
    ),
    ("regions: [{name: us}]", "regions[0]: missing 'sites'"),
    ("regions: {us: [a, b, c]}", "regions: must be a list of regions"),
    (
        "regions: [{name: us, sites: [a, b, c], egres_mbit: 3}]",
        "regions[0].egres_mbit: unknown key; did you mean 'egress_mbit'?",
    ),
    (
        "wan: {between_regions: {rtt_ms: 140}}",
        "wan.between_regions: the job has no regions: add a regions: section",
    ),
    (
        "regions: [{name: all, sites: [a, b, c]}]\nwan: {between_regions: {rtt_ms: -1}}",
        "wan.between_regions.rtt_ms:",
    ),
]


@pytest.mark.parametrize(
    ("section", "expected"),
    BAD,
    ids=[
        *("unknown-site", "site-in-two", "site-in-none", "egress-zero", "egress-negative"),
        *("name-twice", "no-sites", "not-a-list", "unknown-key", "between-without-regions"),
        "between-bad-link",
    ],
)
def test_bad_regions_are_refused_naming_the_field(section, expected):
    text = "name: x\nsites: [{name: a}, {name: b}, {name: c}]\n" + section + "\n"
    with pytest.raises(JobFileError) as info:
        parse_job(textwrap.dedent(text), source="job.yaml")
    assert any(expected in line for line in info.value.lines()), info.value.lines()


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ("train: {algorithm: two_level}", "train.algorithm: two_level needs the sites' regions"),
        ("train: {algorithm: auto}", "train.algorithm: auto picks from the links' costs"),
        ("train: {algorithm: tree}", "train.algorithm: unknown algorithm 'tree'; use one of"),
    ],
    ids=["two-level-without-regions", "auto-without-links", "unknown"],
)
def test_a_bad_algorithm_is_refused_naming_the_field(section, expected):
    text = "name: x\nsites: [{name: a}, {name: b}, {name: c}]\n" + section + "\n"
    with pytest.raises(JobFileError) as info:
        parse_job(text, source="job.yaml")
    assert any(expected in line for line in info.value.lines()), info.value.lines()


def test_a_job_with_regions_averages_in_two_levels_unless_it_says_otherwise():
    assert parse_job(NINE_SITES).algorithm == "two_level"
    assert parse_job(NINE_SITES + "train: {algorithm: auto}\n").algorithm == "auto"
    # No regions: on emulated links (known costs) each round takes the faster of one
    # trip and two; on a real WAN, whose links no job states, direct.
    assert parse_job("name: x\nsites: [{name: a}, {name: b}]\n").algorithm == "direct"
    emulated = "name: x\nsites: [{name: a}, {name: b}]\nwan: {default: {rtt_ms: 50}}\n"
    assert parse_job(emulated).algorithm == "auto"
    assert parse_job(emulated + "train: {algorithm: gather}\n").algorithm == "gather"


FOUR_SITES_TWO_REGIONS = """\
name: two-regions
sites: [{name: a}, {name: b}, {name: c}, {name: d, ranks: 2}]
regions:
  - {name: us, sites: [a, b, c], egress_mbit: 200}
  - {name: eu, sites: [d]}
wan:
  default: {rtt_ms: 4, bandwidth_mbit: 1000}
  between_regions: {rtt_ms: 60, bandwidth_mbit: 200}
train: {strategy: diloco, steps: 8, sync_every: 4, warmup_steps: 2, eval_every: 0,
        codec: int8, error_feedback: true, connections_per_peer: 2}
"""


@pytest.mark.slow
def test_a_run_across_regions_averages_in_two_levels_and_ends_identical(tmp_path):
    """isthmus run with regions: every round in two levels (regions of 3 and 1 sites,
    a site of 2 ranks and so 2 lanes), int8 with error feedback, every rank's chunks
    dealt over two connections per peer, one model at the end."""
    import json
    import subprocess
    import sys

    job = tmp_path / "job.yaml"
    job.write_text(FOUR_SITES_TWO_REGIONS)
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "isthmus", "run", str(job), "--out", str(out), "--no-report"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert len({s["param_sha256"] for s in summary["sites"].values()}) == 1
    assert all(s["outer_steps"] == 2 for s in summary["sites"].values())
    # Two levels: us's sites reach d only for their slice of the way across, while
    # inside us each sends its slices' results to the others in float32; flat
    # direct would carry the same int8 shares on every link.
    by_link = summary["wan_bytes_by_link"]
    assert by_link["a<->b"] > 2 * by_link["a<->d"], by_link


@pytest.mark.slow
def test_sixteen_sites_train_one_model(tmp_path):
    """isthmus run with 16 one-rank sites (120 links): every site makes the first
    round and ends with the same parameters."""
    import json
    import subprocess
    import sys

    names = [f"s{i:02d}" for i in range(16)]
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: sixteen\nsites: [" + ", ".join(f"{{name: {n}}}" for n in names) + "]\n"
        "wan: {default: {rtt_ms: 60, bandwidth_mbit: 200}}\n"
        "train: {strategy: diloco, steps: 10, sync_every: 5, warmup_steps: 2, eval_every: 0}\n"
    )
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "isthmus", "run", str(job), "--out", str(out), "--no-report"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    sites = summary["sites"]
    assert sorted(sites) == names
    assert all(s["status"] == "finished" and s["outer_steps"] == 2 for s in sites.values())
    assert len({s["param_sha256"] for s in sites.values()}) == 1

"""``isthmus site --resume RUN_DIR``: which round a job's sites go on from, agreed at the broker.

Each site keeps its checkpoints in its own run directory, on its own cluster,
so no site sees the others'. A site started with ``--resume`` first looks at
the other sites' retained statuses:

- **another site is live** (``state: online``): it has trained on since any
  checkpoint this site holds, so this site rejoins the live ones and pulls
  their state (as ``--rejoin``). A live site always wins: its state is at
  least as new as any checkpoint.
- **none is**: the job resumes when every site does, from the newest round of
  which every site holds a complete checkpoint (a site killed while writing
  its newest holds the one before). The job file's first site leads: it
  publishes a request with a fresh nonce, every site answers with its rounds,
  the leader publishes the round, every site acknowledges, and the leader
  clears the request and the decision, so that no later resume can read them.
  A site takes a decision only for the nonce it answered and only if it lists
  the rounds it holds now. The leader also clears the stopped run's retained
  membership view and site statuses: the resumed job starts from every site,
  as a new run does.

A site of several nodes takes part node by node: every node of it runs
``isthmus site --resume`` and answers with the rounds it sees, under
``<site>/node<k>`` (node 0 under the site's name), and the leader (node 0 of
the first site) waits for every node's answer and acknowledgement. A round
counts only if every node of every site holds it, so a site whose nodes do not
share the run directory's file system is refused by name instead of starting
its nodes from different rounds.

Topics, all under ``isthmus/<job>/resume/`` and retained: ``request``
(``nonce``), ``answer/<node>`` (``nonce``, ``rounds``), ``decision``
(``nonce``, ``round`` or ``error``, ``rounds``), ``ack/<node>`` (``nonce``),
where ``<node>`` is a site's name or ``<site>/node<k>``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isthmus.deploy.usage import UsageError
from isthmus.inter.control_topics import decode, encode, membership_topic, status_topic
from isthmus.intra.checkpoint_files import checkpoint_number, complete_checkpoints
from isthmus.job.file import Job, SiteSpec, load_job
from isthmus.training.log_format import say

WAIT_S = 600.0
"""How long a resuming site waits for the others to resume too."""
SAY_EVERY_S = 30.0


@dataclass(frozen=True)
class ResumePlan:
    """How a resuming site starts: from ``round`` (every site from the same), or, with
    ``live`` sites, by rejoining them."""

    round: int | None
    live: tuple[str, ...] = ()
    rounds: dict[str, list[int]] | None = None


def node_label(site: str, node: int) -> str:
    """How a node answers in the agreement: node 0 as its site."""
    return site if node == 0 else f"{site}/node{node}"


def check_run_dir(run_dir: Path, job: Job, spec: SiteSpec) -> list[int]:
    """The rounds of which this site holds a complete checkpoint in ``run_dir``;
    refuses, naming --resume and the fix, a directory of another job or site, a
    finished one, or one without checkpoints."""
    own = run_dir / "job.yaml"
    if not own.is_file():
        shared = (
            f" (site {spec.name!r} has {spec.nodes} nodes: its run directory must be on a "
            "file system every one of them shares)"
            if spec.nodes > 1
            else ""
        )
        raise UsageError(
            f"--resume: {run_dir} is not a site's run directory (no job.yaml){shared}; give "
            f"the --out of the site's earlier run (default runs/{job.name}-{spec.name})"
        )
    kept = load_job(own, check_files=False)
    if kept.name != job.name:
        raise UsageError(
            f"--resume: {run_dir} holds a run of job {kept.name!r}, not {job.name!r}; give "
            f"the run directory of job {job.name!r}"
        )
    if not (run_dir / "sites" / spec.name).is_dir():
        others = sorted(p.name for p in (run_dir / "sites").glob("*") if p.is_dir())
        raise UsageError(
            f"--resume: {run_dir} holds site {', '.join(others) or 'no site'}'s run, not "
            f"{spec.name!r}'s; give this site's own run directory"
        )
    if (run_dir / "sites" / spec.name / "result.json").exists():
        raise UsageError(f"--resume: the run in {run_dir} finished; nothing to go on with")
    rounds = sorted(
        checkpoint_number(p)
        for p in complete_checkpoints(run_dir / "checkpoints" / spec.name, "round")
    )
    if not rounds:
        hint = (
            "the job has train.checkpoint_every: 0 (no checkpoints); set it to resume sites"
            if not job.train.checkpoint_every
            else "the site stopped before it wrote its first checkpoint"
        )
        raise UsageError(f"--resume: no checkpoint of site {spec.name!r} in {run_dir}: {hint}")
    return rounds


def plan_resume(
    job: Job, site: str, rounds: list[int], *, node: int = 0, wait_s: float = WAIT_S
) -> ResumePlan:
    """Agree with the other sites (see the module's doc) how this site starts;
    ``node``: which node of a site of several nodes this is."""
    assert job.control is not None
    return asyncio.run(_agree(job, site, node, rounds, wait_s))


def _topic(job: Job, *parts: str) -> str:
    return "/".join(("isthmus", job.name, "resume", *parts))


async def _agree(job: Job, site: str, node: int, rounds: list[int], wait_s: float) -> ResumePlan:
    assert job.control is not None
    sites = [s.name for s in job.sites]
    nodes = [node_label(s.name, k) for s in job.sites for k in range(s.nodes)]
    me, leader = node_label(site, node), nodes[0]
    answer_prefix, ack_prefix = _topic(job, "answer", ""), _topic(job, "ack", "")
    broker = job.control.broker_for(site)
    nonce = secrets.token_hex(8)
    answered: str | None = None
    answers: dict[str, list[int]] = {}
    acks: set[str] = set()
    decided: dict[str, Any] | None = None
    started = last_said = time.monotonic()
    client_id = f"isthmus-resume-{job.name}-{site}-{node}-{secrets.token_hex(4)}"
    async with broker.client(client_id) as client:
        await client.subscribe(f"isthmus/{job.name}/sites/+/status", qos=1)
        await client.subscribe(_topic(job, "#"), qos=1)
        if me == leader:
            await client.publish(_topic(job, "decision"), b"", qos=1, retain=True)
            await client.publish(
                _topic(job, "request"), encode({"nonce": nonce}), qos=1, retain=True
            )
            answers[me] = rounds
        messages = client.messages.__aiter__()
        while True:
            now = time.monotonic()
            if now - started > wait_s:
                missing = [n for n in nodes if n not in answers] if me == leader else [leader]
                raise UsageError(
                    f"--resume: waited {wait_s:g} s for sites {', '.join(missing)} to resume "
                    "(or to be live); start them with --resume too (every node of a site "
                    "of several nodes)"
                )
            if now - last_said > SAY_EVERY_S:
                last_said = now
                say(f"waiting for the other sites to resume (leader {leader})", prefix=f"{me}: ")
            try:
                message = await asyncio.wait_for(messages.__anext__(), timeout=1.0)
            except TimeoutError:
                continue
            topic = str(message.topic)
            body = decode(message.payload) if message.payload else {}
            if not isinstance(body, dict):
                continue
            for other in sites:
                live = body.get("state") == "online" and decided is None
                if other != site and topic == status_topic(job.name, other) and live:
                    return ResumePlan(None, live=(other,))
            if me == leader:
                if topic.startswith(answer_prefix) and body.get("nonce") == nonce:
                    answers[topic[len(answer_prefix) :]] = list(body.get("rounds") or [])
                    if decided is None and all(n in answers for n in nodes):
                        decided = _decide(nonce, answers)
                        # The stopped run's last membership view and the sites' last
                        # statuses (retained; "offline") would hold the resumed sites to
                        # who was in and out when it stopped, and a site slower to start
                        # would be taken for lost: the resumed job starts from every
                        # site, as a new run does.
                        stale = [membership_topic(job.name)]
                        stale += [status_topic(job.name, s) for s in sites]
                        for topic_to_clear in stale:
                            await client.publish(topic_to_clear, b"", qos=1, retain=True)
                        await client.publish(
                            _topic(job, "decision"), encode(decided), qos=1, retain=True
                        )
                if topic.startswith(ack_prefix) and body.get("nonce") == nonce:
                    acks.add(topic[len(ack_prefix) :])
                if decided is not None and acks >= set(nodes) - {me}:
                    # Every node has the round: leave nothing a later resume could read.
                    for leftover in ["request", "decision", *(f"answer/{n}" for n in nodes),
                                     *(f"ack/{n}" for n in nodes)]:  # fmt: skip
                        await client.publish(_topic(job, leftover), b"", qos=1, retain=True)
                    return _plan(decided)
                continue
            if topic == _topic(job, "request") and body.get("nonce") != answered:
                answered = body.get("nonce")
                await client.publish(
                    _topic(job, "answer", me),
                    encode({"nonce": answered, "rounds": rounds}),
                    qos=1,
                    retain=True,
                )
            elif (
                topic == _topic(job, "decision")
                and answered is not None
                and body.get("nonce") == answered
                and (body.get("rounds") or {}).get(me) == rounds
            ):
                await client.publish(
                    _topic(job, "ack", me), encode({"nonce": answered}), qos=1, retain=True
                )
                return _plan(body)


def _decide(nonce: str, answers: dict[str, list[int]]) -> dict[str, Any]:
    common = set.intersection(*(set(r) for r in answers.values()))
    decision: dict[str, Any] = {"nonce": nonce, "rounds": answers}
    if common:
        decision["round"] = max(common)
    else:
        held = "; ".join(f"{s}: {r}" for s, r in sorted(answers.items()))
        decision["error"] = f"no round of which every site holds a checkpoint ({held})"
        if any("/node" in label for label in answers):
            decision["error"] += (
                "; a site of several nodes needs its run directory on a file system "
                "every node shares"
            )
    return decision


def _plan(decision: dict[str, Any]) -> ResumePlan:
    if "error" in decision:
        raise UsageError(f"--resume: {decision['error']}; the job must start over")
    return ResumePlan(int(decision["round"]), rounds=decision.get("rounds"))


def describe(plan: ResumePlan, rounds: list[int]) -> str:
    if plan.round is None:
        return (
            f"site {', '.join(plan.live)} is live: rejoining it and pulling its state, newer "
            f"than this site's checkpoint of round {rounds[-1]}"
        )
    return f"every site resumes after round {plan.round} (checkpoints: {json.dumps(plan.rounds)})"

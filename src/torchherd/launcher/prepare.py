"""Before a job runs: connect to every node, probe it, check it, plan the job.

    cluster -> connect every node (one ssh master each, in parallel)
            -> quick probe (NodeFacts) -> fast preflight -> LaunchPlan
With ``prewarm`` (a launch), each node's agent session opens first: torchrun's wrapper imports
torch meanwhile, and the agent answers the probe over its link (one session a node). ``replan``
makes the plan of a restart on the nodes that still answer. With env_sync, the probe runs the
environment's own python and the nodes that differ are synced before anything starts
(``envs/at_launch.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..agent.protocol import missing_module
from ..errors import NodeNotReady, NodesUnreachable
from ..facts import NodeFacts
from ..plan import JobSpec, LaunchPlan, check_group_split, make_plan
from ..spec import ClusterSpec, NodeSpec, read_env_file
from ..startup import process_started
from ..transport import CommandResult, Transport
from ..transport.base import setup_failure
from .links import AgentLink

if TYPE_CHECKING:
    from ..envs.at_launch import LaunchEnvironment

Progress = Callable[[str], None]
StartMarks = dict[str, dict[str, float]]
"""host -> mark -> moment (this launcher's monotonic clock): startup.py's marks."""


async def connect_all(
    cluster: ClusterSpec, transport: Transport, marks: StartMarks | None = None
) -> None:
    """Open a link to every node in parallel; NodeNotReady naming each unreachable node.
    ``marks``: when each node's link was up (the start's phases, startup.py)."""

    async def connect(node: NodeSpec) -> Any:
        found = await transport.connect(node)
        if marks is not None:
            marks.setdefault(node.host, {})["connected"] = time.monotonic()
        return found

    results = await transport.each(cluster.nodes, connect)
    failures = [r for r in results if r is not None]
    if failures:
        lines = "\n".join(f"  {f.describe()}\n    fix: {f.remedy}" for f in failures)
        raise NodesUnreachable(
            f"{len(failures)} of {len(cluster.nodes)} node(s) unreachable:\n{lines}",
            unreachable_remedy(cluster, [f.host for f in failures]),
            hosts=tuple(f.host for f in failures),
        )


# Names of this machine a user may type for "here" (-H localhost:2, torchrun's habit).
THIS_MACHINE = {"localhost", "127.0.0.1", "::1", "localhost.localdomain"}


def unreachable_remedy(cluster: ClusterSpec, hosts: list[str]) -> str:
    """What to do about nodes that cannot be reached, in the words of where they came from:
    -H or a cluster file; this machine, named, needs no ssh at all."""
    where = "-H" if cluster.source == "-H" else "the cluster file"
    fix = f"fix the nodes above, or leave them out of {where}"
    if cluster.source == "-H" and {h.split("@")[-1] for h in hosts} & THIS_MACHINE:
        fix = (
            "to run on this machine alone, leave -H out (herd launch --nproc N train.py runs "
            f"N workers here, without ssh); else {fix}"
        )
    return fix


async def probe_all(
    cluster: ClusterSpec,
    transport: Transport,
    *,
    workdir: str | None = None,
    entry: dict[str, str] | None = None,
    port_on_first: int | None = None,
    full: bool = False,
    timeout: float = 60,
    links: Mapping[str, AgentLink] | None = None,
    failures: dict[str, str] | None = None,
    marks: StartMarks | None = None,
) -> dict[str, NodeFacts]:
    """Run the quick probe on every node in parallel. NodeNotReady when a node cannot answer,
    unless ``failures`` is given: then each such node's line goes there, by host.

    A node with an agent link open (``links``) is asked over it: one session a node, not
    two. Where the link cannot answer, the node is probed in a session of its own, whose
    failure says why (no python, no torchherd, a failed setup). ``marks``: when each node's
    agent was ready and its answer came (the start's phases, startup.py)."""

    async def probe(node: NodeSpec) -> NodeFacts | str:
        port = port_on_first if node is cluster.rendezvous_node else None
        link = links.get(node.host) if links else None
        if link is not None:
            request = probe_request(workdir, port, full, entry)
            answer = await link.probe(request, min(timeout, LINK_PROBE_WAIT))
            if answer is not None:
                if marks is not None:
                    now = time.monotonic()
                    node_marks = marks.setdefault(node.host, {})
                    node_marks["probed"] = now
                    if link.agent_for is not None:
                        node_marks["agent"] = now - link.agent_for
                return facts_of(node, answer)
        found = await probe_node(cluster, transport, node, workdir, port, full, timeout, entry)
        if marks is not None:
            marks.setdefault(node.host, {})["probed"] = time.monotonic()
        return found

    results = await transport.each(cluster.nodes, probe)
    problems = [r for r in results if isinstance(r, str)]
    if failures is not None:
        for node, result in zip(cluster.nodes, results, strict=True):
            if isinstance(result, str):
                failures[node.host] = result
        problems = []
    if problems:
        raise NodeNotReady(
            "some nodes cannot run torchherd:\n" + "\n".join(f"  {p}" for p in problems),
            "fix each node as said above, then run `herd doctor`",
            hosts=tuple(p.split(":", 1)[0] for p in problems),
        )
    return {facts.host: facts for facts in results if isinstance(facts, NodeFacts)}


# How long a link's agent may take to answer the probe before the node is probed in a session
# of its own (an agent of an older version ignores the question).
LINK_PROBE_WAIT = 15.0


def probe_request(
    workdir: str | None, port: int | None, full: bool, entry: dict[str, str] | None
) -> dict[str, object]:
    """What the probe is asked: the facts (``full``: herd doctor's), whether the workdir and
    the job's script or module are there, whether ``port`` is free."""
    request: dict[str, object] = {"full": full}
    if workdir:
        request["workdir"] = workdir
    if entry:
        request["entry"] = entry  # is the job's script or module there (checked from workdir)
    if port is not None:
        request["port"] = port
    return request


def facts_of(node: NodeSpec, answer: object) -> NodeFacts | str:
    """A probe's answer as NodeFacts, or the line saying it was not facts (anything but the
    probe's JSON object, None included)."""
    try:
        return NodeFacts.from_probe(node.host, answer)  # type: ignore[arg-type]
    except (ValueError, TypeError, KeyError, AttributeError):
        return f"{node.host}: the probe answered with something that is not JSON"


async def probe_node(
    cluster: ClusterSpec,
    transport: Transport,
    node: NodeSpec,
    workdir: str | None = None,
    port: int | None = None,
    full: bool = False,
    timeout: float = 60,
    entry: dict[str, str] | None = None,
) -> NodeFacts | str:
    """One node's quick probe in a session of its own: its facts, or one line saying why
    there are none."""
    python = cluster.python_for(node)
    result = await transport.run(
        node,
        [python, "-m", "torchherd.agent", "probe"],
        input=json.dumps(probe_request(workdir, port, full, entry)).encode(),
        timeout=timeout,
    )
    if not result.ok:
        return explain_probe_failure(node, python, result)
    try:
        answer = json.loads(result.stdout)
    except ValueError:
        answer = None  # facts_of says it was not facts
    return facts_of(node, answer)


def explain_probe_failure(node: NodeSpec, python: str, result: CommandResult) -> str:
    """One line (host first) saying why the probe failed on a node, with the fix."""
    if result.unreachable is not None:
        return f"{result.unreachable.describe()}; fix: {result.unreachable.remedy}"
    if result.timed_out:
        return f"{node.host}: the probe did not answer in time; fix: check the node's load and disk"
    code, stderr = result.returncode, result.stderr
    prelude = setup_failure(code, stderr)
    if prelude is not None:
        shown = prelude.replace("\n", "\n    ")
        return (
            f"{node.host}: the setup commands failed; their output:\n    {shown}\n"
            "  fix: correct setup in [cluster] (or this [[node]]) of the cluster file"
        )
    if code == 127 or ("not found" in stderr and missing_module(stderr) is None):
        return (
            f"{node.host}: {python} not found; fix: install Python 3.11+ there or set python "
            "in [cluster] (or for this [[node]]) to its interpreter's full path"
        )
    if missing_module(stderr) == "torchherd":
        return (
            f"{node.host}: torchherd is not installed for {python}; fix: pip install torchherd "
            "there (`herd exec -- python3 -m pip install torchherd`)"
        )
    last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit code {code}"
    return f"{node.host}: the probe failed: {last}"


def fast_preflight(
    cluster: ClusterSpec, facts: Mapping[str, NodeFacts], joining: tuple[str, ...] = ()
) -> list[str]:
    """The checks that make a launch fail for sure, as problem lines (empty: go ahead);
    ``joining``: nodes about to join the others' running job (preflight.fast_checks)."""
    from ..preflight import Status, fast_checks

    return [r.line() for r in fast_checks(cluster, facts, joining) if r.status is Status.FAIL]


@dataclass(frozen=True)
class Prepared:
    """Everything a launch learned before starting: enough to plan a restart too."""

    cluster: ClusterSpec
    """The cluster the plan runs on, its workdir resolved."""
    facts: dict[str, NodeFacts]
    secrets: dict[str, str]
    plan: LaunchPlan
    links: dict[str, AgentLink] = field(default_factory=dict)
    """Agent links opened while probing or planning (torchrun's wrapper importing torch
    meanwhile), by host; the attempt runs in them."""
    environment: str | None = None
    """With env_sync: the environment every node runs, and which nodes were synced for it."""
    marks: StartMarks = field(default_factory=dict)
    """A launch's start so far, per node (startup.py): the launcher's start, each node
    connected, its agent ready, its probe answered (this launcher's monotonic clock)."""
    origin: float | None = None
    """When the command started (the launcher process), on the same clock."""


async def prepare(
    cluster: ClusterSpec,
    job: JobSpec,
    transport: Transport,
    *,
    preflight: bool = True,
    progress: Progress | None = None,
    prewarm: bool = False,
) -> Prepared:
    """Connect, probe and check every node, then make the plan. With ``prewarm``, each node's
    agent link is opened first: it starts importing torch at once, and answers the probe."""
    say = progress or (lambda _: None)
    entered = time.monotonic()
    origin = process_started(entered)
    secrets = read_env_file(cluster.env_file) if cluster.env_file else {}
    cluster = cluster.with_workdir().with_spares(job.spares)
    if job.replica_groups:
        check_group_split(len(cluster.active), job.group_nodes)  # before any node is touched
    environment = None
    if cluster.env_sync:
        from ..envs.at_launch import LaunchEnvironment

        environment = LaunchEnvironment.of(cluster)
        cluster = environment.cluster(cluster)
    marks: StartMarks = {node.host: {"launcher": entered} for node in cluster.nodes}
    say(f"connecting to {len(cluster.nodes)} node(s)")
    await connect_all(cluster, transport, marks)
    say("probing nodes")
    # With prewarm, the agents' sessions open first: each warms torchrun's wrapper at once
    # and answers the probe over its link.
    opening = asyncio.create_task(open_links(cluster, transport, job)) if prewarm else None
    links: dict[str, AgentLink] = {}
    try:
        links = await opening if opening is not None else {}
        unanswered: dict[str, str] | None = {} if environment is not None else None
        facts = await probe_all(
            cluster,
            transport,
            workdir=cluster.workdir,
            entry=job.entry_request(),
            port_on_first=cluster.rdzv_port or 0,
            links=links if opening is not None else None,
            failures=unanswered,
            marks=marks,
        )
        if environment is not None:
            await sync_environment(
                environment, cluster, job, transport, facts, links, say, prewarm=prewarm
            )
        problems = fast_preflight(cluster, facts)
        if problems and preflight:
            raise NodeNotReady(
                "preflight found problems:\n" + "\n".join(f"  {p}" for p in problems),
                "fix them, or launch anyway with --no-preflight",
                hosts=tuple(p.split(":", 1)[0] for p in problems),
            )
        # Spares are checked and warmed with the others, but the plan leaves them out.
        plan = make_plan(cluster.select(n.host for n in cluster.active), job, facts, secrets)
        refuse_public_rendezvous(cluster, facts, plan)
    except BaseException:
        if opening is not None:
            await close_links(await opening)  # the same dict as ``links``, as changed
        raise
    summary = environment.summary(list(cluster.nodes)) if environment is not None else None
    return Prepared(
        cluster,
        facts,
        secrets,
        plan,
        links,
        summary,
        marks=marks,
        origin=origin or entered,
    )


async def sync_environment(
    environment: LaunchEnvironment,
    cluster: ClusterSpec,
    job: JobSpec,
    transport: Transport,
    facts: dict[str, NodeFacts],
    links: dict[str, AgentLink],
    say: Progress,
    *,
    prewarm: bool,
) -> None:
    """env_sync: the nodes whose probe found no environment or another hash are synced, then
    probed again (``facts`` and ``links`` updated in place); the others are left alone."""
    hosts = [n.host for n in cluster.nodes]
    differing = environment.differing(hosts, {h: f.env_hash for h, f in facts.items()})
    if not differing:
        return
    say(f"syncing environment {environment.target.hash} on {', '.join(differing)}")
    # Their agents (if any started) run another environment, or none: end them first.
    await close_links({h: links.pop(h) for h in differing if h in links})
    await environment.sync(cluster, transport, differing, say)
    again = cluster.select(differing)
    if prewarm:
        links.update(await open_links(cluster, transport, job, list(again.nodes)))
    first = cluster.rendezvous_node.host in differing
    fresh = await probe_all(
        again,
        transport,
        workdir=cluster.workdir,
        entry=job.entry_request(),
        port_on_first=(cluster.rdzv_port or 0) if first else None,
        links={h: links[h] for h in differing if h in links} if prewarm else None,
    )
    facts.update(fresh)
    still = environment.differing(differing, {h: f.env_hash for h, f in fresh.items()})
    if still:
        lines = "\n".join(
            f"  {h}: {environment.python} reports environment {fresh[h].env_hash}" for h in still
        )
        raise NodeNotReady(
            f"after the sync, {len(still)} node(s) still differ from environment "
            f"{environment.target.hash}:\n{lines}",
            "something beyond the environment is on those nodes' Python path (PYTHONPATH, "
            "setup commands): remove it, or launch without --env-sync",
            hosts=tuple(still),
        )


def refuse_public_rendezvous(
    cluster: ClusterSpec, facts: Mapping[str, NodeFacts], plan: LaunchPlan
) -> None:
    """The one check --no-preflight does not skip (and a restart on a new rendezvous host
    makes again): the c10d store must not listen on a public address unless allowed."""
    if cluster.transport == "local" or plan.rdzv_endpoint is None:
        return
    from ..preflight.network_checks import rendezvous_exposure

    first = cluster.rendezvous_node
    planned = plan.nodes[0].local_addr
    found = rendezvous_exposure(cluster, first, facts[first.host], planned)
    if found is not None:
        raise NodeNotReady(f"{first.host}: {found.summary}", found.remedy, hosts=(first.host,))


async def open_links(
    cluster: ClusterSpec,
    transport: Transport,
    job: JobSpec,
    nodes: list[NodeSpec] | None = None,
) -> dict[str, AgentLink]:
    """An agent link per node (every node of the cluster, or ``nodes``), told to prewarm:
    start torchrun's wrapper for the job's attempt, which imports torch while the launcher
    plans. A node where this fails simply gets a link when its attempt starts."""

    async def open_one(node: NodeSpec) -> AgentLink | None:
        spec = {
            "python": cluster.python_for(node),
            "workdir": cluster.workdir,
            "job_id": job.job_id,
            "attempt": job.attempt,
        }
        try:
            return await AgentLink.open(transport, cluster, node, prewarm=spec)
        except (OSError, ConnectionError):
            return None

    chosen = list(cluster.nodes if nodes is None else nodes)
    opened = await transport.each(chosen, open_one)
    return {n.host: link for n, link in zip(chosen, opened, strict=True) if link is not None}


async def close_links(links: Mapping[str, AgentLink]) -> None:
    """End links (their agents end what runs there and exit), waiting for each."""
    for link in links.values():
        link.start_reading()
    await asyncio.gather(*(link.finish() for link in links.values()))


async def replan(
    prepared: Prepared,
    job: JobSpec,
    transport: Transport,
    *,
    nodes: list[str],
    links: Mapping[str, AgentLink] | None = None,
) -> Prepared:
    """The plan of a restart on ``nodes`` (hosts of the cluster, the first hosting the
    rendezvous): a fresh rendezvous id and a port free now on the first node, the public
    address refused again if the rendezvous moved. Nodes with a live link (``links``) need
    no new one; the others get one now, warming the attempt's wrapper while this plans."""
    full, facts = prepared.cluster, dict(prepared.facts)
    links = links or {}
    cluster = full.select(nodes)
    without_link = [n for n in cluster.nodes if n.host not in links or not links[n.host].alive]
    opening = asyncio.create_task(open_links(cluster, transport, job, without_link))
    try:
        if cluster.transport != "local":
            first = cluster.rendezvous_node
            fresh = await probe_all(
                cluster.select([first.host]), transport, port_on_first=cluster.rdzv_port or 0
            )
            facts[first.host] = fresh[first.host]
        plan = make_plan(cluster, job, facts, prepared.secrets)
        refuse_public_rendezvous(cluster, facts, plan)
    except BaseException:
        await close_links(await opening)
        raise
    return Prepared(full, facts, prepared.secrets, plan, await opening)

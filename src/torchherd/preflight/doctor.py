"""`herd doctor` as a library call: gather findings from every node, then judge them.

    connect (ssh, in parallel) -> one agent session per node: full probe, listeners
    -> the launch plan -> TCP tests through the sessions
    -> [shared storage: a token per --path, looked for on the other nodes, with --path]
    -> checks -> [all-reduce through `herd launch`, with --collective: handed in by the caller,
       since it runs a job and the checks sit below the launcher] -> PreflightReport

Unlike a launch, nothing here stops at the first broken node: each node's trouble becomes its
row of the report, and the others are still examined.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..facts import NodeFacts
from ..spec import ClusterSpec, NodeSpec
from ..transport import Transport, Unreachable, for_cluster
from . import make_report, run_checks
from .findings import Findings, Limits, ProbeFailure, StorageFindings, plan_for
from .network import NetOptions, Session, network_tests
from .report import BusBandwidth, CheckResult, PreflightReport, Status
from .storage import storage_tests

Say = Callable[[str], None]
# (cluster, processes per node) -> the collective's row and its bus bandwidths
RunCollective = Callable[[ClusterSpec, int | None], tuple[CheckResult, tuple[BusBandwidth, ...]]]

# Asks a node's interpreter what it has, when torchherd itself is missing there. Any Python 3.
_WHAT_IS_INSTALLED = (
    "import json, sys\n"
    "from importlib.util import find_spec\n"
    "def has(name):\n"
    "    try:\n"
    "        return find_spec(name) is not None\n"
    "    except Exception:\n"
    "        return False\n"
    "print(json.dumps({'version': '.'.join(map(str, sys.version_info[:3])),"
    " 'torch': has('torch'), 'torchherd': has('torchherd')}))\n"
)


@dataclass(frozen=True)
class DoctorOptions:
    """What `herd doctor` examines and how hard."""

    nproc: int | None = None
    """Workers per node to check for (like launch's --nproc)."""
    full: bool = False
    """Test every pair of nodes instead of the star around the rendezvous node."""
    collective: bool = False
    """Also run a real all-reduce across all nodes through `herd launch`."""
    fresh: bool = False
    """Import torch on every node even where the probe remembers the result."""
    limits: Limits = field(default_factory=Limits)
    net: NetOptions = field(default_factory=NetOptions)
    probe_timeout: float = 120.0
    """Seconds a node's probe may take (it imports torch, which can be slow on a busy node)."""
    paths: tuple[str, ...] = ()
    """Directories (or URLs) checked on every node: there, writable, the same storage."""


def doctor(
    cluster: ClusterSpec,
    options: DoctorOptions | None = None,
    *,
    transport: Transport | None = None,
    say: Say | None = None,
    run_collective: RunCollective | None = None,
) -> PreflightReport:
    """Examine every node and return the report (never raises for a broken node).
    ``run_collective`` (``bench.collective.run_collective``) runs the all-reduce job for
    ``--collective``: it launches a job, so the caller above the launcher hands it in and the
    checks never import the launcher."""
    options = options or DoctorOptions()
    say = say or (lambda _: None)
    started = time.monotonic()
    cluster = cluster.with_workdir()  # where a launch would run the job, checked the same way
    findings = asyncio.run(gather(cluster, options, transport or for_cluster(cluster), say))
    extra: tuple[CheckResult, ...] = ()
    rows: tuple[BusBandwidth, ...] = ()
    if options.collective:
        if any(r.status is Status.FAIL for r in run_checks(findings)):
            extra = (
                CheckResult(
                    "collective",
                    None,
                    Status.SKIP,
                    "all-reduce not run: fix the failures above first",
                ),
            )
        else:
            if run_collective is None:
                raise ValueError("doctor(collective=True) needs run_collective")
            say("running an all-reduce across all nodes")
            result, rows = run_collective(cluster, options.nproc)
            extra = (result,)
    return make_report(findings, extra=extra, collective=rows, seconds=time.monotonic() - started)


async def gather(
    cluster: ClusterSpec, options: DoctorOptions, transport: Transport, say: Say
) -> Findings:
    """Everything the checks need; sessions and the transport are closed on every path."""
    sessions: dict[str, Session] = {}
    try:
        total = len(cluster.nodes)
        done = 0

        def tick(stage: str, of: int) -> Callable[[NodeSpec, object], None]:
            def on_done(_: NodeSpec, __: object) -> None:
                nonlocal done
                done += 1
                say(f"{stage} {done}/{of}")

            return on_done

        say(f"connecting 0/{total}")
        connected = await transport.each(
            cluster.nodes, transport.connect, tick("connecting", total)
        )
        unreachable = {u.host: u for u in connected if isinstance(u, Unreachable)}
        reachable = [n for n in cluster.nodes if n.host not in unreachable]
        done = 0
        say(f"probing 0/{len(reachable)}")

        async def probe(node: NodeSpec) -> NodeFacts | ProbeFailure:
            outcome = await _probe(cluster, transport, node, options)
            if isinstance(outcome, tuple):
                sessions[node.host] = outcome[1]
                return outcome[0]
            return outcome

        probed = await transport.each(reachable, probe, tick("probing", len(reachable)))
        facts = {p.host: p for p in probed if isinstance(p, NodeFacts)}
        failures = {p.host: p for p in probed if isinstance(p, ProbeFailure)}
        network, skipped = None, ""
        if cluster.transport != "local":
            outcome = plan_for(cluster, facts, options.nproc)
            if outcome.plan is not None:
                network = await network_tests(cluster, outcome.plan, sessions, options.net, say)
            else:
                skipped = f"not tested: {outcome.error}"
        storage: tuple[StorageFindings, ...] = ()
        if options.paths:
            storage = await storage_tests(
                options.paths,
                sessions,
                [n.host for n in cluster.nodes],
                cluster.workdir or "",
                say=say,
            )
        return Findings(
            cluster=cluster,
            facts=facts,
            unreachable=unreachable,
            probe_failures=failures,
            network=network,
            network_skipped=skipped,
            nproc=options.nproc,
            limits=options.limits,
            storage=storage,
            env_torch=lock_torch(cluster),
        )
    finally:
        await asyncio.gather(*(session.close() for session in sessions.values()))
        await transport.close()


def lock_torch(cluster: ClusterSpec) -> str | None:
    """The torch of the environment the cluster syncs (env_sync or env_lock), None without
    one: the driver check judges each node's driver against its CUDA build."""
    if not (cluster.env_sync or cluster.env_lock):
        return None
    from ..envs.at_launch import target_for

    return target_for(cluster).packages.get("torch")


async def _probe(
    cluster: ClusterSpec, transport: Transport, node: NodeSpec, options: DoctorOptions
) -> tuple[NodeFacts, Session] | ProbeFailure:
    """Start the node's agent session; its first answer is the full probe."""
    probe: dict[str, object] = {"full": True, "fresh": options.fresh}
    if cluster.workdir:
        probe["workdir"] = cluster.workdir
    ports: dict[str, int] = {"ephemeral": 0}
    if node is cluster.rendezvous_node and cluster.transport != "local":
        ports["rdzv"] = cluster.rdzv_port or 0
    python = cluster.python_for(node)
    session = await Session.start(cluster, transport, node, {"probe": probe, "ports": ports})
    hello = await session.hello(options.probe_timeout)
    if hello is not None:
        try:
            return NodeFacts.from_probe(node.host, hello["facts"]), session
        except (ValueError, TypeError, KeyError) as exc:
            await session.close()
            return ProbeFailure(
                node.host,
                python,
                "bad-output",
                f"the probe answered with something that is not its JSON ({exc})",
            )
    if session.timed_out:
        return ProbeFailure(
            node.host, python, "timeout", f"no answer within {options.probe_timeout:g} s"
        )
    stderr = session.stderr
    code = session.returncode
    last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit code {code}"
    if code == 127 or ("not found" in stderr and "No module" not in stderr):
        return ProbeFailure(node.host, python, "no-python", last)
    if "No module named" in stderr or "SyntaxError" in stderr:
        return await _what_is_installed(transport, node, python, last)
    return ProbeFailure(node.host, python, "error", last)


async def _what_is_installed(
    transport: Transport, node: NodeSpec, python: str, last: str
) -> ProbeFailure:
    """torchherd did not run: ask the bare interpreter its version and what it has."""
    result = await transport.run(node, [python, "-c", _WHAT_IS_INSTALLED], timeout=30)
    try:
        answer = json.loads(result.stdout)
    except ValueError:
        return ProbeFailure(node.host, python, "error", last)
    version = str(answer.get("version", ""))
    major_minor = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    kind = "old-python" if major_minor < (3, 11) else "no-torchherd"
    return ProbeFailure(
        node.host, python, kind, last, python_version=version, has_torch=bool(answer.get("torch"))
    )

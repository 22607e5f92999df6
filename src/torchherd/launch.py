"""`herd launch` as a library call: connect, probe, check, plan, supervise, tear down.

    cluster -> connect every node (one ssh master each, in parallel)
            -> quick probe (NodeFacts) -> fast preflight -> LaunchPlan -> Supervisor -> RunResult
Teardown (closing ssh masters) runs in ``finally`` on every path.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from . import __version__
from .agent.protocol import missing_module
from .errors import EXIT_JOB_FAILED, ConfigError, HerdError, Interrupted, NodeNotReady
from .facts import NodeFacts
from .jobs import job_dir
from .logs import JobOutput, RunResult, render_summary
from .ops.jobctl import new_record
from .plan import JobSpec, LaunchPlan, make_plan
from .redact import redact_text
from .spec import ClusterSpec, NodeSpec, read_env_file
from .transport import CommandResult, Transport, for_cluster

Progress = Callable[[str], None]


@dataclass(frozen=True)
class LaunchOptions:
    """How to launch, beyond what to run."""

    dry_run: bool = False
    """Print the plan and start nothing."""
    log_dir: Path | None = None
    """Where per-rank logs go; default: the job directory."""
    preflight: bool = True
    """Refuse to start when a fast check fails (unreachable, no torch, versions, port)."""
    color: bool | None = None
    """Colour the prefixes; default: when stdout is a terminal."""
    detach: bool = False
    """Return once every node has started; the job runs on without the launcher."""


async def connect_all(cluster: ClusterSpec, transport: Transport) -> None:
    """Open a link to every node in parallel; NodeNotReady naming each unreachable node."""
    results = await transport.each(cluster.nodes, transport.connect)
    failures = [r for r in results if r is not None]
    if failures:
        lines = "\n".join(f"  {f.describe()}\n    fix: {f.remedy}" for f in failures)
        raise NodeNotReady(
            f"{len(failures)} of {len(cluster.nodes)} node(s) unreachable:\n{lines}",
            "fix the nodes above, or leave them out of the cluster file",
            hosts=tuple(f.host for f in failures),
        )


async def probe_all(
    cluster: ClusterSpec,
    transport: Transport,
    *,
    workdir: str | None = None,
    entry: dict[str, str] | None = None,
    port_on_first: int | None = None,
    full: bool = False,
    timeout: float = 60,
) -> dict[str, NodeFacts]:
    """Run the quick probe on every node in parallel. NodeNotReady when a node cannot answer."""

    async def probe(node: NodeSpec) -> NodeFacts | str:
        request: dict[str, object] = {"full": full}
        if workdir:
            request["workdir"] = workdir
        if entry:
            request["entry"] = entry  # is the job's script or module there (checked from workdir)
        if node is cluster.rendezvous_node and port_on_first is not None:
            request["port"] = port_on_first
        python = cluster.python_for(node)
        result = await transport.run(
            node,
            [python, "-m", "torchherd.agent", "probe"],
            input=json.dumps(request).encode(),
            timeout=timeout,
        )
        if result.ok:
            try:
                return NodeFacts.from_probe(node.host, json.loads(result.stdout))
            except (ValueError, TypeError, KeyError):
                return f"{node.host}: the probe answered with something that is not JSON"
        return explain_probe_failure(node, python, result)

    results = await transport.each(cluster.nodes, probe)
    problems = [r for r in results if isinstance(r, str)]
    if problems:
        raise NodeNotReady(
            "some nodes cannot run torchherd:\n" + "\n".join(f"  {p}" for p in problems),
            "fix each node as said above, then run `herd doctor`",
            hosts=tuple(p.split(":", 1)[0] for p in problems),
        )
    return {facts.host: facts for facts in results if isinstance(facts, NodeFacts)}


def explain_probe_failure(node: NodeSpec, python: str, result: CommandResult) -> str:
    """One line (host first) saying why the probe failed on a node, with the fix."""
    if result.unreachable is not None:
        return f"{result.unreachable.describe()}; fix: {result.unreachable.remedy}"
    if result.timed_out:
        return f"{node.host}: the probe did not answer in time; fix: check the node's load and disk"
    code, stderr = result.returncode, result.stderr
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


def fast_preflight(cluster: ClusterSpec, facts: Mapping[str, NodeFacts]) -> list[str]:
    """The checks that make a launch fail for sure, as problem lines (empty: go ahead)."""
    from .preflight import Status, fast_checks

    return [r.line() for r in fast_checks(cluster, facts) if r.status is Status.FAIL]


@dataclass(frozen=True)
class Prepared:
    """Everything a launch learned before starting: enough to plan a restart too."""

    cluster: ClusterSpec
    """The cluster, its workdir resolved."""
    facts: dict[str, NodeFacts]
    secrets: dict[str, str]
    plan: LaunchPlan


async def prepare(
    cluster: ClusterSpec,
    job: JobSpec,
    transport: Transport,
    *,
    preflight: bool = True,
    progress: Progress | None = None,
) -> Prepared:
    """Connect, probe and check every node, then make the plan."""
    say = progress or (lambda _: None)
    secrets = read_env_file(cluster.env_file) if cluster.env_file else {}
    cluster = with_workdir(cluster)
    say(f"connecting to {len(cluster.nodes)} node(s)")
    await connect_all(cluster, transport)
    say("probing nodes")
    facts = await probe_all(
        cluster,
        transport,
        workdir=cluster.workdir,
        entry=job.entry_request(),
        port_on_first=cluster.rdzv_port or 0,
    )
    problems = fast_preflight(cluster, facts)
    if problems and preflight:
        raise NodeNotReady(
            "preflight found problems:\n" + "\n".join(f"  {p}" for p in problems),
            "fix them, or launch anyway with --no-preflight",
            hosts=tuple(p.split(":", 1)[0] for p in problems),
        )
    return Prepared(cluster, facts, secrets, make_plan(cluster, job, facts, secrets))


async def replan(prepared: Prepared, job: JobSpec, transport: Transport) -> LaunchPlan:
    """The plan for a restart: the same nodes, a fresh rendezvous id and a port free now."""
    cluster, facts = prepared.cluster, dict(prepared.facts)
    if cluster.transport == "ssh":
        first = cluster.rendezvous_node
        fresh = await probe_all(
            cluster.select([first.host]), transport, port_on_first=cluster.rdzv_port or 0
        )
        facts[first.host] = fresh[first.host]
    return make_plan(cluster, job, facts, prepared.secrets)


@dataclass(frozen=True)
class RestartPolicy:
    """When the launcher restarts a failed job (all nodes, fresh rendezvous)."""

    max_restarts: int = 0

    def should_restart(self, result: RunResult, restarts_done: int) -> bool:
        # Only a job that ran and failed; never one interrupted or whose nodes are not ready.
        return result.exit_code == EXIT_JOB_FAILED and restarts_done < self.max_restarts


def with_workdir(cluster: ClusterSpec) -> ClusterSpec:
    """The job runs in [cluster] workdir, or else in the launcher's current directory (the
    same path on every node: a shared filesystem or a `herd sync`ed copy)."""
    if cluster.workdir:
        return cluster
    return cluster.model_copy(update={"workdir": os.getcwd()})


def banner(plan: LaunchPlan, cluster: ClusterSpec) -> str:
    where = (
        f"rendezvous {plan.rdzv_endpoint}" if plan.rdzv_endpoint else "standalone on this machine"
    )
    nodes = ", ".join(f"{n.host}×{n.nproc}" for n in plan.nodes)
    return (
        f"herd {__version__}: job {plan.job_id} on {len(plan.nodes)} node(s) [{nodes}], "
        f"world size {plan.world_size}, {where}"
    )


def launch(
    cluster: ClusterSpec,
    job: JobSpec,
    options: LaunchOptions | None = None,
    *,
    stream: TextIO | None = None,
    err: TextIO | None = None,
    transport: Transport | None = None,
) -> RunResult | LaunchPlan:
    """Run the job to its end and return its result (or the plan, for a dry run)."""
    options = options or LaunchOptions()
    return asyncio.run(
        _launch(cluster, job, options, stream or sys.stdout, err or sys.stderr, transport)
    )


async def _launch(
    cluster: ClusterSpec,
    job: JobSpec,
    options: LaunchOptions,
    stream: TextIO,
    err: TextIO,
    transport: Transport | None,
) -> RunResult | LaunchPlan:
    transport = transport or for_cluster(cluster)
    loop = asyncio.get_running_loop()
    try:
        progress = _Progress(err)
        preparing = asyncio.create_task(
            prepare(cluster, job, transport, preflight=options.preflight, progress=progress)
        )
        _on_signals(loop, preparing.cancel)
        try:
            prepared = await preparing
        except asyncio.CancelledError:
            raise Interrupted("interrupted before the job started; nothing was started") from None
        finally:
            progress.clear()
        plan = prepared.plan
        if options.dry_run:
            return plan
        if options.detach:
            from .ops.detach import start_detached

            return await start_detached(
                cluster,
                plan,
                transport,
                stream,
                log_dir=options.log_dir,
                banner=banner(plan, cluster),
            )
        return await _supervise(prepared, job, transport, options, stream, loop)
    finally:
        _restore_signals(loop)
        await transport.close()


async def _supervise(
    prepared: Prepared,
    job: JobSpec,
    transport: Transport,
    options: LaunchOptions,
    stream: TextIO,
    loop: asyncio.AbstractEventLoop,
    policy: RestartPolicy | None = None,
) -> RunResult:
    from .supervise import Supervisor

    cluster, plan = prepared.cluster, prepared.plan
    policy = policy or RestartPolicy(job.max_restarts)
    log_dir = options.log_dir or job_dir(plan.job_id)
    secrets = list(plan.secret_env.values())
    output = JobOutput(
        log_dir,
        [n.host for n in plan.nodes],
        plan.world_size,
        stream=stream,
        color=options.color,
        secrets=secrets,
    )
    record = new_record(cluster, plan, log_dir, state="running")
    record.save()
    output.note(banner(plan, cluster))
    started = time.monotonic()
    restarts = 0
    interrupted = False
    supervisor = Supervisor(plan, cluster, transport, output)

    def interrupt() -> None:
        nonlocal interrupted
        interrupted = True
        supervisor.interrupt()

    _on_signals(loop, interrupt)
    try:
        while True:
            result = await supervisor.run()
            if interrupted or not policy.should_restart(result, restarts):
                break
            restarts += 1
            cause = result.first_failure.headline() if result.first_failure else "a node failed"
            output.note(
                f"herd: {cause}; restarting the job on every node "
                f"(restart {restarts} of {policy.max_restarts})"
            )
            try:
                plan = await replan(prepared, replace(job, attempt=restarts), transport)
            except HerdError as exc:
                output.note(f"herd: cannot restart: {exc.message}")
                break
            record.rdzv_endpoint = plan.rdzv_endpoint
            record.save()
            supervisor = Supervisor(plan, cluster, transport, output)
    finally:
        output.flush()
    result.restarts = restarts
    result.duration = time.monotonic() - started
    output.note(render_summary(result))
    output.close()
    record.state = {0: "succeeded", 130: "stopped"}.get(result.exit_code, "failed")
    record.ended = time.time()
    record.exit_code = result.exit_code
    record.restarts = restarts
    if result.first_failure is not None:
        failure = result.first_failure
        record.first_failure = {
            "host": failure.host,
            "rank": failure.rank,
            "exitcode": failure.exitcode,
            "signal": failure.signal,
            "message": redact_text(failure.message, secrets),
        }
    record.save()
    return result


class _Progress:
    """One status line on a terminal ("connecting to 8 node(s)..."), erased when work starts."""

    def __init__(self, err: TextIO) -> None:
        self.err = err
        self.shown = False

    def __call__(self, text: str) -> None:
        if self.err.isatty():
            self.err.write(f"\r\x1b[2K{text}...")
            self.err.flush()
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.err.write("\r\x1b[2K")
            self.err.flush()
            self.shown = False


def _on_signals(loop: asyncio.AbstractEventLoop, handler: Callable[[], object]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, handler)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread, or not POSIX


def _restore_signals(loop: asyncio.AbstractEventLoop) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.remove_signal_handler(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass


__all__ = ["LaunchOptions", "launch", "prepare", "probe_all", "connect_all", "ConfigError"]

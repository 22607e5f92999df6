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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from . import __version__
from .agent.protocol import missing_module
from .errors import (
    EXIT_CRASH_LOOP,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_SAVED,
    ConfigError,
    HerdError,
    Interrupted,
    NodeNotReady,
)
from .facts import NodeFacts
from .jobs import JobRecord, attempt_entry, job_dir
from .logs import JobOutput, RunResult, render_summary
from .ops.jobctl import new_record
from .plan import JobSpec, LaunchPlan, make_plan
from .recovery import HangWatch, RestartPolicy
from .recovery.policy import made_progress
from .redact import redact_text
from .spec import ClusterSpec, NodeSpec, read_env_file
from .transport import CommandResult, Transport, for_cluster
from .transport.base import setup_failure

Progress = Callable[[str], None]


@dataclass(frozen=True)
class LaunchOptions:
    """How to launch, beyond what to run."""

    dry_run: bool = False
    """Print the plan and start nothing."""
    ranks: frozenset[int] | None = None
    """Global ranks whose lines reach the console (None: every rank); every rank's lines are
    kept in the job's files all the same (logs.JobOutput's ``ranks``)."""
    log_dir: Path | None = None
    """Where per-rank logs go; default: the job directory."""
    preflight: bool = True
    """Refuse to start when a fast check fails (unreachable, no torch, versions, port)."""
    color: bool | None = None
    """Colour the prefixes; default: when stdout is a terminal."""
    detach: bool = False
    """Return once every node has started; the job runs on without the launcher."""
    hang_timeout: float | None = None
    """Seconds without progress from any rank that make a hang; None learns the limit from the
    job (recovery.hang), 0 turns the watch off."""
    save_within: float = 60.0
    """On SIGUSR1 (a scheduler's time-limit warning) workers are asked to save a snapshot and
    stop; after this many seconds whatever still runs is stopped. The result's exit code is then
    EXIT_SAVED (5): the job should be requeued."""


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
        port = port_on_first if node is cluster.rendezvous_node else None
        return await probe_node(cluster, transport, node, workdir, port, full, timeout, entry)

    results = await transport.each(cluster.nodes, probe)
    problems = [r for r in results if isinstance(r, str)]
    if problems:
        raise NodeNotReady(
            "some nodes cannot run torchherd:\n" + "\n".join(f"  {p}" for p in problems),
            "fix each node as said above, then run `herd doctor`",
            hosts=tuple(p.split(":", 1)[0] for p in problems),
        )
    return {facts.host: facts for facts in results if isinstance(facts, NodeFacts)}


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
    """One node's quick probe: its facts, or one line saying why there are none."""
    request: dict[str, object] = {"full": full}
    if workdir:
        request["workdir"] = workdir
    if entry:
        request["entry"] = entry  # is the job's script or module there (checked from workdir)
    if port is not None:
        request["port"] = port
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
    sessions: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)
    """Agent sessions opened while probing (torchrun's wrapper importing torch meanwhile),
    by host; the first attempt runs in them."""


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
    agent session is opened while the probe runs, and starts importing torch at once."""
    say = progress or (lambda _: None)
    secrets = read_env_file(cluster.env_file) if cluster.env_file else {}
    cluster = with_workdir(cluster)
    say(f"connecting to {len(cluster.nodes)} node(s)")
    await connect_all(cluster, transport)
    say("probing nodes")
    opening = asyncio.create_task(open_sessions(cluster, transport, job)) if prewarm else None
    try:
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
        plan = make_plan(cluster, job, facts, secrets)
        refuse_public_rendezvous(cluster, facts, plan)
    except BaseException:
        if opening is not None:
            await close_sessions(await opening)
        raise
    sessions = await opening if opening is not None else {}
    return Prepared(cluster, facts, secrets, plan, sessions)


def refuse_public_rendezvous(
    cluster: ClusterSpec, facts: Mapping[str, NodeFacts], plan: LaunchPlan
) -> None:
    """The one check --no-preflight does not skip (and a restart on a new rendezvous host
    makes again): the c10d store must not listen on a public address unless allowed."""
    if cluster.transport == "local" or plan.rdzv_endpoint is None:
        return
    from .preflight.network_checks import rendezvous_exposure

    first = cluster.rendezvous_node
    planned = plan.nodes[0].local_addr
    found = rendezvous_exposure(cluster, first, facts[first.host], planned)
    if found is not None:
        raise NodeNotReady(f"{first.host}: {found.summary}", found.remedy, hosts=(first.host,))


async def open_sessions(
    cluster: ClusterSpec, transport: Transport, job: JobSpec
) -> dict[str, asyncio.subprocess.Process]:
    """An agent session per node, told to prewarm (start torchrun's wrapper, which imports
    torch while the launcher plans). A node where this fails simply gets a session later."""

    async def open_one(node: NodeSpec) -> asyncio.subprocess.Process | None:
        python = cluster.python_for(node)
        spec = {
            "python": python,
            "workdir": cluster.workdir,
            "job_id": job.job_id,
            "attempt": job.attempt,
        }
        try:
            process = await transport.start(node, [python, "-m", "torchherd.agent", "run"])
            assert process.stdin is not None
            process.stdin.write(json.dumps({"prewarm": spec | {"node": node.name}}).encode())
            process.stdin.write(b"\n")
            return process
        except (OSError, ConnectionError):
            return None

    opened = await transport.each(cluster.nodes, open_one)
    return {n.host: p for n, p in zip(cluster.nodes, opened, strict=True) if p is not None}


async def close_sessions(sessions: Mapping[str, asyncio.subprocess.Process]) -> None:
    """End prewarmed sessions that will not run a job (their agents end their wrappers)."""
    for process in sessions.values():
        if process.stdin is not None and not process.stdin.is_closing():
            process.stdin.close()

    async def ended(process: asyncio.subprocess.Process) -> None:
        try:
            await asyncio.wait_for(process.wait(), 5)
        except TimeoutError:
            try:
                process.kill()
            except ProcessLookupError:
                pass
            await process.wait()

    await asyncio.gather(*(ended(p) for p in sessions.values()))


async def replan(
    prepared: Prepared,
    job: JobSpec,
    transport: Transport,
    policy: RestartPolicy,
    suspects: tuple[str, ...] = (),
    say: Callable[[str], None] = lambda _: None,
) -> Prepared:
    """The plan for a restart: a fresh rendezvous id and a port free now, on the nodes that
    still answer. When ``suspects`` (nodes lost in the last attempt) do not answer again, the
    job goes on without them if the policy allows, the first live node hosting the rendezvous."""
    cluster, facts = prepared.cluster, dict(prepared.facts)
    if suspects and cluster.transport != "local":
        timeout = cluster.connect_timeout + 5
        answers = await transport.each(
            cluster.nodes,
            lambda node: probe_node(cluster, transport, node, cluster.workdir, timeout=timeout),
        )
        alive = [a.host for a in answers if isinstance(a, NodeFacts)]
        facts.update({a.host: a for a in answers if isinstance(a, NodeFacts)})
        gone = [n.host for n in cluster.nodes if n.host not in alive]
        if gone:
            total = len(prepared.cluster.nodes)
            if not policy.enough_nodes(len(alive), total):
                needed = policy.min_nodes or total
                raise NodeNotReady(
                    f"{', '.join(gone)} still do(es) not answer: {len(alive)} node(s) left, "
                    f"{needed} needed",
                    "bring the node back, or allow going on with fewer nodes "
                    "(--min-nodes M, or min_nodes in [cluster])",
                    hosts=tuple(gone),
                )
            cluster = cluster.select(alive)
            say(
                f"herd: going on without {', '.join(gone)}: {len(alive)} node(s) left, "
                f"rendezvous now on {cluster.rendezvous_node.host}"
            )
    opening = asyncio.create_task(open_sessions(cluster, transport, job))
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
        await close_sessions(await opening)
        raise
    return Prepared(cluster, facts, prepared.secrets, plan, await opening)


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
            prepare(
                cluster,
                job,
                transport,
                preflight=options.preflight,
                progress=progress,
                prewarm=not (options.dry_run or options.detach),
            )
        )
        _on_signals(loop, preparing.cancel)
        time_limit = False

        def time_limit_before_start() -> None:
            # A scheduler's time-limit warning (SIGUSR1) before the job even started: start
            # nothing, and say "saved" so that the job is requeued (its last snapshot stands).
            nonlocal time_limit
            time_limit = True
            preparing.cancel()

        _on_save_signal(loop, time_limit_before_start)
        try:
            prepared = await preparing
        except asyncio.CancelledError:
            if time_limit:
                stream.write("herd: the time limit is near; the job was not started\n")
                return RunResult(job.job_id, EXIT_SAVED, reason="the time limit came first")
            raise Interrupted("interrupted before the job started; nothing was started") from None
        finally:
            progress.clear()
        plan = prepared.plan
        if options.dry_run:
            return plan
        if options.detach:
            return await _start_detached(prepared, options, transport, stream, loop)
        return await _supervise(prepared, job, transport, options, stream, loop)
    finally:
        _restore_signals(loop)
        await transport.close()


# Why a detached start is stopped when the scheduler's time-limit warning comes.
_TIME_LIMIT = "the time limit is near"


async def _start_detached(
    prepared: Prepared,
    options: LaunchOptions,
    transport: Transport,
    stream: TextIO,
    loop: asyncio.AbstractEventLoop,
) -> RunResult:
    """Start the job detached; Ctrl-C while it starts stops it on every node.

    A time-limit warning (SIGUSR1) while it starts stops it too: herd is about to leave, so
    nobody would be there to ask the job to save, and the job has not trained yet. It ends
    with EXIT_SAVED, as before the start, so that the scheduler requeues it.

    The nodes are stopped once each has answered: a start in flight cannot be called back
    (its agent may start the job a moment after a stop swept the node), so a stop before the
    answers could leave the job running. A second signal stops waiting.
    """
    from .ops.detach import start_detached
    from .ops.jobctl import stop_nodes

    cluster, plan = prepared.cluster, prepared.plan
    starting = asyncio.create_task(
        start_detached(
            cluster,
            plan,
            transport,
            stream,
            log_dir=options.log_dir,
            banner=banner(plan, cluster),
        )
    )
    why: str | None = None

    def stop_once_answered(reason: str) -> None:
        nonlocal why
        if why is not None:
            starting.cancel()  # asked twice: stop without waiting for the answers
            return
        why = reason
        stream.write(
            f"herd: {reason} while the job was starting; it will be stopped on every node "
            "once each has answered (again to stop now)\n"
        )
        stream.flush()

    _on_signals(loop, lambda: stop_once_answered("interrupted"))
    _on_save_signal(loop, lambda: stop_once_answered(_TIME_LIMIT))
    try:
        result = await starting
    except asyncio.CancelledError:
        result = None
    if why is None and result is not None:
        return result
    stream.write("herd: stopping the job on every node\n")
    stream.flush()
    record = new_record(cluster, plan, options.log_dir or job_dir(plan.job_id), state="running")
    record.detached = True
    await stop_nodes(record, plan.grace, transport)
    if why == _TIME_LIMIT:
        stream.write("herd: the job was stopped before it trained; its last snapshot stands\n")
        return RunResult(plan.job_id, EXIT_SAVED, reason="the time limit came first")
    raise Interrupted(
        "interrupted while the job was starting; it was stopped on every node",
        f"nothing of job {plan.job_id} is left; launch it again when ready",
    )


async def _supervise(
    prepared: Prepared,
    job: JobSpec,
    transport: Transport,
    options: LaunchOptions,
    stream: TextIO,
    loop: asyncio.AbstractEventLoop,
    policy: RestartPolicy | None = None,
) -> RunResult:
    """Run the job, restarting it (every node, a fresh rendezvous) as the policy allows."""
    from .supervise import Supervisor

    plan = prepared.plan
    policy = policy or job_policy(job, prepared.cluster)
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
    record = new_record(prepared.cluster, plan, log_dir, state="running")
    record.attempts.append(
        attempt_entry(job.attempt, record.nodes, plan.world_size, plan.rdzv_endpoint)
    )
    record.save()
    output.note(banner(plan, prepared.cluster))
    started = time.monotonic()
    restarts = no_progress = 0
    best_step: int | None = None
    interrupted = saving = False
    replanning: asyncio.Task[Prepared] | None = None
    result = RunResult(plan.job_id, EXIT_JOB_FAILED, log_dir=log_dir)

    def attempt(plan: LaunchPlan) -> Supervisor:
        return Supervisor(
            plan,
            prepared.cluster,
            transport,
            output,
            hang=HangWatch(options.hang_timeout),
            evidence_dir=log_dir / "stacks" / f"attempt-{job.attempt + restarts}",
            sessions=prepared.sessions,
        )

    supervisor = attempt(plan)

    def interrupt() -> None:
        nonlocal interrupted
        interrupted = True
        supervisor.interrupt()
        if replanning is not None:
            replanning.cancel()

    def save_and_stop() -> None:
        nonlocal saving
        saving = True
        supervisor.request_save(options.save_within)

    _on_signals(loop, interrupt)
    _on_save_signal(loop, save_and_stop)
    try:
        while True:
            attempt_started = time.monotonic()
            result = await supervisor.run()
            close_attempt(record.attempts[-1], result, supervisor, secrets)
            record.save()
            if interrupted or saving or not policy.should_restart(result.exit_code, restarts):
                break
            seconds = time.monotonic() - attempt_started
            if made_progress(best_step, result.max_step, seconds):
                no_progress = 0
            elif restarts:  # a restart that got nowhere: the crash loop counts restarts
                no_progress += 1
            if result.max_step is not None:
                best_step = max(best_step or 0, result.max_step)
            if no_progress >= policy.crash_loop:
                result.exit_code = EXIT_CRASH_LOOP
                result.reason = (
                    f"crash loop: {no_progress} restart(s) in a row failed without step progress "
                    f"(best step {best_step if best_step is not None else 'none'}); fix the "
                    "first failure above, restarting will not"
                )
                break
            restarts += 1
            cause = result.first_failure.headline() if result.first_failure else "a node failed"
            output.note(
                f"herd: {cause}; restarting the job (restart {restarts} of {policy.max_restarts})"
            )
            replanning = asyncio.create_task(
                replan(
                    prepared,
                    replace(job, attempt=job.attempt + restarts),
                    transport,
                    policy,
                    suspects=result.lost,
                    say=output.note,
                )
            )
            try:
                prepared = await replanning
            except asyncio.CancelledError:
                result.exit_code = EXIT_INTERRUPTED
                break
            except HerdError as exc:
                output.note(f"herd: cannot restart: {exc.message}\n  fix: {exc.remedy}")
                result.reason = exc.message
                break
            finally:
                replanning = None
            if interrupted:
                result.exit_code = EXIT_INTERRUPTED
                break
            plan = prepared.plan
            record.nodes = [{"host": n.host, "nproc": n.nproc} for n in plan.nodes]
            record.world_size = plan.world_size
            record.rdzv_endpoint = plan.rdzv_endpoint
            record.attempts.append(
                attempt_entry(
                    job.attempt + restarts,
                    record.nodes,
                    plan.world_size,
                    plan.rdzv_endpoint,
                    how="new plan",
                    why=cause,
                )
            )
            record.save()
            supervisor = attempt(plan)
    finally:
        result.restarts = restarts
        result.duration = time.monotonic() - started
        output.note(render_summary(result))
        output.close()
        finish_record(record, result, secrets)
    return result


def close_attempt(
    entry: dict[str, Any], result: RunResult, supervisor: Any, secrets: list[str]
) -> None:
    """Fill an attempt's record entry once it has ended (see jobs.attempt_entry)."""
    entry["ended"] = time.time()
    entry["outcome"] = outcome_of(result)
    entry["noticed"] = supervisor.noticed or ""
    entry["behind"] = list(result.behind)
    entry["stacks_dir"] = str(result.stacks_dir) if result.stacks_dir else None
    entry["max_step"] = result.max_step
    entry["failure"] = failure_record(result, secrets)


def outcome_of(result: RunResult) -> str:
    if result.exit_code == 0:
        return "succeeded"
    if result.exit_code == EXIT_SAVED:
        return "saved"
    if result.exit_code == EXIT_INTERRUPTED:
        return "interrupted"
    if result.hang:
        return "hung"
    if result.lost:
        return "lost"
    return "failed"


def failure_record(result: RunResult, secrets: list[str]) -> dict[str, Any] | None:
    failure = result.first_failure
    if failure is None:
        return None
    return {
        "host": failure.host,
        "rank": failure.rank,
        "exitcode": failure.exitcode,
        "signal": failure.signal,
        "message": redact_text(failure.message, secrets),
        "cause": failure.cause,
        "remedy": failure.remedy,
    }


def job_policy(job: JobSpec, cluster: ClusterSpec) -> RestartPolicy:
    """The restart policy a job asks for (the command line wins over [cluster])."""
    return RestartPolicy(
        max_restarts=job.max_restarts,
        min_nodes=job.min_nodes if job.min_nodes is not None else cluster.min_nodes,
        crash_loop=job.crash_loop,
    )


def finish_record(record: JobRecord, result: RunResult, secrets: list[str]) -> None:
    """The job record once the launcher is done: never left "running"."""
    record.state = {0: "succeeded", EXIT_INTERRUPTED: "stopped", EXIT_SAVED: "saved"}.get(
        result.exit_code, "failed"
    )
    record.ended = time.time()
    record.exit_code = result.exit_code
    record.restarts = result.restarts
    if result.first_failure is not None:
        record.first_failure = failure_record(result, secrets)
    record.save()


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


# Signals that stop the job: Ctrl-C, `kill`, and a closed terminal.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _on_signals(loop: asyncio.AbstractEventLoop, handler: Callable[[], object]) -> None:
    for sig in _STOP_SIGNALS:
        try:
            loop.add_signal_handler(sig, handler)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread, or not POSIX


def _on_save_signal(loop: asyncio.AbstractEventLoop, handler: Callable[[], object]) -> None:
    """SIGUSR1: a scheduler's warning before the time limit (Slurm --signal=B:USR1@T)."""
    try:
        loop.add_signal_handler(signal.SIGUSR1, handler)
    except (NotImplementedError, RuntimeError, ValueError):
        pass


def _restore_signals(loop: asyncio.AbstractEventLoop) -> None:
    for sig in (*_STOP_SIGNALS, signal.SIGUSR1):
        try:
            loop.remove_signal_handler(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass


__all__ = ["LaunchOptions", "launch", "prepare", "probe_all", "connect_all", "ConfigError"]

"""`herd launch` as a library call: prepare, then run the job (or only print its plan).

    cluster -> prepare (connect, probe, check, plan: prepare.py)
            -> --dry-run: the plan | --detach: start and return | JobRun: attempts -> RunResult
Signals are wired to what runs at the moment (a start, a job); teardown (closing ssh masters)
runs in ``finally`` on every path.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from ..errors import EXIT_SAVED, ConfigError, Interrupted, NodesUnreachable
from ..job_nodes import new_record
from ..plan import JobSpec, LaunchPlan
from ..records import job_dir
from ..results import RunResult
from ..spec import ClusterSpec
from ..transport import Transport, for_cluster
from ..transport.children import wait_for_children_with_pidfds
from .prepare import (
    Prepared,
    connect_all,
    fast_preflight,
    prepare,
    probe_all,
    refuse_public_rendezvous,
)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class LaunchOptions:
    """How to launch, beyond what to run."""

    dry_run: bool = False
    """Print the plan and start nothing."""
    ranks: frozenset[int] | None = None
    """Global ranks whose lines reach the console (None: every rank); every rank's lines are
    kept in the job's files all the same (logs.JobOutput's ``ranks``)."""
    every_rank: bool = False
    """--ranks all: every rank's lines reach the launcher even on a large job (by default
    one of more than LARGE_JOB_NODES nodes sends rank 0's and every stderr line)."""
    log_dir: Path | None = None
    """Where per-rank logs go; default: the job directory."""
    preflight: bool = True
    """Refuse to start when a fast check fails (unreachable, no torch, versions, port)."""
    color: bool | None = None
    """Colour the prefixes; default: when stdout is a terminal."""
    detach: bool = False
    """Return once every node has started; the job runs on without the launcher."""
    hang_timeout: float | None = None
    """None judges hangs by evidence only (recovery.hang); S > 0 adds a plain limit of S
    seconds without progress from any rank; 0 turns the watch off."""
    save_within: float = 60.0
    """On SIGUSR1 (a scheduler's time-limit warning) workers are asked to save a snapshot and
    stop; after this many seconds whatever still runs is stopped. The result's exit code is then
    EXIT_SAVED (5): the job should be requeued."""
    verbose: bool = False
    """Print each start's phases (connect, probe, rendezvous, ... first step) once its first
    step is made."""


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
    wait_for_children_with_pidfds()  # no thread per ssh client (transport/children.py)
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
    transport = transport or for_cluster(cluster, tree=True)
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
        except NodesUnreachable as exc:
            if not options.dry_run:
                raise
            from .dry_run import offline_plan

            return offline_plan(cluster, job, exc.message)
        except asyncio.CancelledError:
            if time_limit:
                stream.write("herd: the time limit is near; the job was not started\n")
                return RunResult(job.job_id, EXIT_SAVED, reason="the time limit came first")
            raise Interrupted("interrupted before the job started; nothing was started") from None
        finally:
            progress.clear()
        if prepared.environment:
            err.write(f"herd: {prepared.environment}\n")
        if options.verbose:
            for line in transport.route_lines():
                stream.write(f"herd: {line}\n")
        plan = prepared.plan
        if options.dry_run:
            from .dry_run import spare_notes

            return replace(plan, notes=(*plan.notes, *spare_notes(prepared.cluster)))
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
    from ..job_nodes import stop_nodes
    from .detach import start_detached
    from .job import banner

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
) -> RunResult:
    """Run the job (a sequence of attempts) with the signals wired to it."""
    # Imported once the nodes are prepared: the job's machinery is not needed before, and
    # its import then overlaps the nodes' torchrun wrappers importing torch (startup.py's
    # "wrapper warm") instead of delaying the ssh connects ("launcher start").
    from .groups import GroupsRun
    from .job import JobRun

    run: GroupsRun | JobRun
    if job.replica_groups:
        run = GroupsRun(
            prepared,
            job,
            transport,
            stream=stream,
            log_dir=options.log_dir,
            color=options.color,
            hang_timeout=options.hang_timeout,
        )
    else:
        run = JobRun(
            prepared,
            job,
            transport,
            stream=stream,
            hang_timeout=options.hang_timeout,
            save_within=options.save_within,
            log_dir=options.log_dir,
            color=options.color,
            ranks=options.ranks,
            every_rank=options.every_rank,
            verbose=options.verbose,
        )
    _on_signals(loop, run.interrupt)
    _on_save_signal(loop, run.save_and_stop)
    return await run.run()


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


__all__ = [
    "ConfigError",
    "LaunchOptions",
    "Prepared",
    "connect_all",
    "fast_preflight",
    "launch",
    "prepare",
    "probe_all",
    "refuse_public_rendezvous",
]

"""The HerdError tree: every error a user can cause or meet carries a remedy and an exit code.

The CLI prints ``error: <message>`` and ``  fix: <remedy>`` and exits with ``exit_code``; a
traceback is shown only with ``--debug``. Library code raises these instead of calling sys.exit.
"""

from __future__ import annotations

# Exit codes shared by every command.
EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_NODE_NOT_READY = 3
EXIT_CRASH_LOOP = 4
"""Restarts kept failing without any step progress; herd gave up early."""
EXIT_SAVED = 5
"""The job saved a snapshot and stopped on request (a time limit or preemption): requeue it."""
EXIT_NEVER_EXITED = 6
"""The job's work finished (the other ranks exited 0), but a rank never exited: herd took its
stacks and ended it. Nothing is restarted: the run is done, and a rerun would only redo it."""
EXIT_INTERRUPTED = 130


class HerdError(Exception):
    """Base class: a message for people, a remedy line and the process exit code."""

    exit_code = EXIT_JOB_FAILED

    def __init__(self, message: str, remedy: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.remedy = remedy
        if remedy:
            # Where nobody catches it (a training script's worker, plain python), Python prints
            # notes under the exception line: the fix reaches the user with the traceback.
            self.add_note(f"fix: {remedy}")

    def __str__(self) -> str:
        return self.message


class ConfigError(HerdError):
    """A cluster file, hostfile, host list or command line is wrong (exit 2)."""

    exit_code = EXIT_USAGE


class UsageError(ConfigError):
    """The command line itself is wrong: a missing script, a conflicting option (exit 2)."""


def cannot_write(path: object, exc: OSError, option: str = "-o") -> UsageError:
    """An output file herd was told to write and cannot (a read-only folder, /proc, a full
    disk): said as a user error, not a traceback."""
    why = exc.strerror or str(exc)
    return UsageError(
        f"cannot write {path}: {why}", f"give {option} a path in a folder you can write"
    )


class NodeNotReady(HerdError):
    """One or more nodes cannot run the job: unreachable, no python, no torch (exit 3)."""

    exit_code = EXIT_NODE_NOT_READY

    def __init__(self, message: str, remedy: str = "", hosts: tuple[str, ...] = ()) -> None:
        super().__init__(message, remedy)
        self.hosts = hosts


class NodesUnreachable(NodeNotReady):
    """Nodes that ssh could not reach at all (a dry run goes on without them, offline)."""


class JobFailed(HerdError):
    """The job ran and failed (exit 1)."""

    exit_code = EXIT_JOB_FAILED


class Interrupted(HerdError):
    """The user interrupted the command; everything started has been stopped (exit 130)."""

    exit_code = EXIT_INTERRUPTED

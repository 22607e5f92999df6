"""Running the typer application: every command module registered, errors turned into one
message and an exit code (a traceback only with ``--debug``)."""

from __future__ import annotations

import difflib
import importlib
import re
import resource
import sys
from typing import Any

import typer

from ..errors import EXIT_INTERRUPTED, EXIT_USAGE, HerdError
from .app import app, state
from .parsing import InterruptedCommand

__all__ = ["app", "dispatch", "register_commands"]

# Command modules, in their order in --help: importing one registers its commands on `app`.
# A command imports only its own module (and what that uses): the others cost a command that
# does not use them a tenth of a second of imports (the launcher's share of a start).
COMMAND_MODULES = {
    "launch": ("launch",),
    "doctor": ("doctor",),
    "ops": ("init", "ssh-setup", "exec", "sync"),
    "jobs": ("ps", "logs", "stop"),
    "report": ("report",),
    "submit": ("submit",),
    "top": ("top",),
    "bench": ("bench",),
    "demo": ("demo",),
    "env": ("env",),
}


def register_commands(args: list[str] | None = None) -> None:
    """Register the command ``args`` names (its first word that is not an option), or every
    command (for --help, a mistyped command, or no ``args``), in --help's order."""
    word = next((a for a in args or () if not a.startswith("-")), None)
    wanted = [m for m, names in COMMAND_MODULES.items() if word in names]
    for module in wanted or COMMAND_MODULES:
        importlib.import_module(f"{__package__}.{module}")
    if not wanted:
        # Modules imported earlier in this process (a test calls main() again) registered
        # first: put every command back in --help's order.
        order = {n: i for i, names in enumerate(COMMAND_MODULES.values()) for n in names}
        app.registered_commands.sort(key=lambda c: order.get(c.name or "", len(order)))
        app.registered_groups.sort(key=lambda g: order.get(g.name or "", len(order)))


def dispatch(argv: list[str] | None = None) -> int:
    """Run herd with ``argv``; return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    raise_open_file_limit()
    state.debug = False  # set by --debug, before the command or among its options
    register_commands(args)
    try:
        result = app(args=args, prog_name="herd", standalone_mode=False)
    except typer.Exit as exc:
        return int(exc.exit_code)
    except InterruptedCommand:
        print("herd: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except typer.Abort:
        print("herd: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except typer.TyperException as exc:
        print_usage_mistake(exc)
        return EXIT_USAGE
    except HerdError as exc:
        if state.debug:
            raise
        print_error(exc)
        return exc.exit_code
    except KeyboardInterrupt:
        print("herd: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return int(result or 0)


def print_usage_mistake(exc: Any) -> None:
    """A command-line mistake: an unknown option names the closest ones; others get typer's
    own message (which names the option and the usage line)."""
    possibilities = getattr(exc, "possibilities", None)
    option = getattr(exc, "option_name", None)
    ctx = getattr(exc, "ctx", None)
    command = ctx.command_path if ctx is not None else "herd"
    if option is not None and hasattr(exc, "possibilities"):
        print(f"error: {command} has no option {option}", file=sys.stderr)
        if possibilities:  # closest first (difflib)
            fix = f"did you mean {possibilities[0]}? ({command} -h lists every option)"
        else:
            fix = f"{command} -h lists every option"
        if ctx is not None and ctx.allow_extra_args and ctx.parent is not None:
            # a command that runs something (not herd itself, whose extra word is a command)
            fix += "; options for the script go after it (or after --)"
        print(f"  fix: {fix}", file=sys.stderr)
        return
    unknown = re.match(r"No such command '(.+?)'", str(getattr(exc, "message", "")))
    if unknown and ctx is not None:
        print(f"error: {command} has no command {unknown[1]!r}", file=sys.stderr)
        print(f"  fix: {command_hint(unknown[1], ctx)}", file=sys.stderr)
        return
    show = getattr(exc, "show", None)
    if callable(show):
        show()
    else:
        print(f"error: {exc}", file=sys.stderr)


# Words other tools use for herd's commands (torchrun, Slurm, docker, kubectl habits).
OTHER_NAMES = {
    "run": "launch",
    "start": "launch",
    "train": "launch",
    "status": "ps",
    "list": "ps",
    "ls": "ps",
    "jobs": "ps",
    "kill": "stop",
    "cancel": "stop",
    "log": "logs",
    "check": "doctor",
    "setup": "ssh-setup",
}


def command_hint(word: str, ctx: Any) -> str:
    """The command a mistyped or borrowed word most likely means."""
    names = sorted(ctx.command.list_commands(ctx)) if hasattr(ctx.command, "list_commands") else []
    meant = OTHER_NAMES.get(word.lower()) if not ctx.parent else None
    if meant not in names:
        close = difflib.get_close_matches(word, names, n=1, cutoff=0.7)
        meant = close[0] if close else None
    listing = f"{ctx.command_path} -h lists every command"
    return f"did you mean `{ctx.command_path} {meant}`? ({listing})" if meant else listing


def raise_open_file_limit() -> None:
    """Lift the soft limit on open files to the hard one: each node holds 3-4 descriptors
    (ssh pipes, a control socket) while a job runs, and the usual soft limit of 1024 runs out
    at about 250 nodes, while the hard limit (often 524288) is ours to take."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit still has a kernel ceiling (fs.nr_open, 1 Mi by default).
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # not ours to raise here: keep what we have


def print_error(exc: HerdError) -> None:
    print(f"error: {exc.message}", file=sys.stderr)
    if exc.remedy:
        print(f"  fix: {exc.remedy}", file=sys.stderr)

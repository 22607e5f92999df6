"""The `herd` command: a thin shell around the library (parse -> call -> render).

Each command group lives in its own module and registers itself on ``app``. ``main(argv)``
returns an exit code instead of exiting, so tests call it directly.
"""

from __future__ import annotations

import resource
import sys

import typer

from ..errors import EXIT_INTERRUPTED, EXIT_USAGE, HerdError
from .app import app, state

# Command modules: importing one registers its commands on `app` (in this order in --help).
# isort: off
from . import launch as _launch  # noqa: F401
from . import doctor as _doctor  # noqa: F401
from . import ops as _ops  # noqa: F401
from . import jobs as _jobs  # noqa: F401
from . import submit as _submit  # noqa: F401
from . import top as _top  # noqa: F401
from . import bench as _bench  # noqa: F401
from . import demo as _demo  # noqa: F401
# isort: on

__all__ = ["app", "main", "run"]


def main(argv: list[str] | None = None) -> int:
    """Run herd with ``argv``; return the exit code (0 ok, 1 job failed, 2 usage, 3 node)."""
    args = list(sys.argv[1:] if argv is None else argv)
    raise_open_file_limit()
    state.debug = "--debug" in args
    try:
        result = app(args=args, prog_name="herd", standalone_mode=False)
    except typer.Exit as exc:
        return int(exc.exit_code)
    except typer.Abort:
        print("herd: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except typer.TyperException as exc:
        # A command-line mistake (bad option value, unknown command): typer's own message,
        # which names the option and the usage line, and exit 2.
        show = getattr(exc, "show", None)
        if callable(show):
            show()
        else:
            print(f"error: {exc}", file=sys.stderr)
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


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())

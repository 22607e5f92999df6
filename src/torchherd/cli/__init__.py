"""The `herd` command: a thin shell around the library (parse -> call -> render).

Each command group lives in its own module and registers itself on ``app`` (see
``dispatch``). ``main(argv)`` returns an exit code instead of exiting, so tests call it directly.

This module imports nothing heavy: typer and the command's module (dispatch.py) take a fifth of a
second to import, and a Ctrl-C in that time must end herd quietly (exit 130), not with a
Python traceback.
"""

import sys

__all__ = ["app", "main", "run"]

EXIT_INTERRUPTED = 130  # errors.EXIT_INTERRUPTED, without importing anything first


def main(argv: list[str] | None = None) -> int:
    """Run herd with ``argv``; return the exit code (0 ok, 1 job failed, 2 usage, 3 node)."""
    try:
        from .dispatch import dispatch

        return dispatch(argv)
    except KeyboardInterrupt:
        print("herd: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())


def __getattr__(name: str) -> object:
    if name == "app":
        from .dispatch import app, register_commands

        register_commands()
        return app
    raise AttributeError(name)

"""The typer application every command module registers on, and options they share."""

from __future__ import annotations

import typer

from .. import __version__
from .parsing import HerdGroup
from .state import state

app = typer.Typer(
    name="herd",
    help="Run one PyTorch training job across many machines as easily as on one.\n\n"
    "Start with `herd demo`. A cluster is described by ./herd.toml (or -c FILE, or -H "
    "gpu1:4,gpu2:4); without one, commands run on this machine alone. --debug (on any "
    "command) shows tracebacks for errors.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    cls=HerdGroup,
)


def _version(value: bool) -> None:
    if value:
        print(f"torchherd {__version__}")
        raise typer.Exit(0)


@app.callback()
def root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Run one PyTorch training job across many machines as easily as on one."""
    state.debug = debug


CLUSTER_HELP = "Cluster file (herd.toml or a hostfile); default: ./herd.toml, else this machine."
HOSTS_HELP = "Hosts instead of a file: gpu1:4,gpu2:4 (HOST or HOST:NPROC, comma-separated)."
NODES_HELP = "Only these nodes of the cluster (comma-separated hosts); default: every node."

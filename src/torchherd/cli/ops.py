"""`herd init`, `herd ssh-setup`, `herd exec`, `herd sync`: getting a cluster ready to run jobs."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn

from ..errors import EXIT_JOB_FAILED, EXIT_NODE_NOT_READY, EXIT_OK, UsageError
from .app import CLUSTER_HELP, HOSTS_HELP, NODES_HELP, app
from .common import cluster_for
from .parsing import RUNS_SOMETHING, HerdCommand
from .tables import result_table

DEFAULT_TOML = Path("herd.toml")
HERE = Path(".")
_COLORS = ("36", "33", "35", "32", "34", "91", "96", "93", "95", "92")


def console(stderr: bool = False) -> Console:
    """Rich output; off a terminal, wide enough that tables are never cut for a pipe or a file."""
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return Console(file=stream, width=None if tty else 200, highlight=False, soft_wrap=not tty)


def human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


# ---------------------------------------------------------------------------------------------
# init


@app.command("init", cls=HerdCommand)
def init_command(
    hosts: Annotated[
        list[str] | None, typer.Argument(help="HOST or HOST:NPROC, as many as you have.")
    ] = None,
    hostfile: str = typer.Option(None, "--hostfile", help="Read hosts from a `HOST slots=N` file."),
    output: Annotated[Path, typer.Option("-o", "--output", help="File to write.")] = DEFAULT_TOML,
    force: bool = typer.Option(False, "--force", help="Replace the file if it exists."),
    probe: bool = typer.Option(False, "--probe", help="Fill nproc from each node's GPU count."),
    python: str = typer.Option(None, "--python", help="Interpreter on the nodes."),
    workdir: str = typer.Option(None, "--workdir", help="Project directory on the nodes."),
    ssh_config: str = typer.Option(None, "--ssh-config", help="ssh config file for the nodes."),
) -> int:
    """Write herd.toml for HOST[:NPROC]... (or --hostfile FILE); --probe asks each node for GPUs.

    Example: herd init gpu1 gpu2:4 10.0.0.7 --probe
    """
    from ..hostlist import nodes_in_words
    from ..ops import init as init_ops

    cluster = init_ops.nodes_from(hosts or [], hostfile)
    if ssh_config and not ssh_config.startswith("~"):
        ssh_config = os.path.abspath(ssh_config)
    code = EXIT_OK
    nodes = list(cluster.nodes)
    comments: dict[str, str] = {}
    if probe:
        probe_cluster = cluster.model_copy(update={"ssh_config": ssh_config})
        probes = init_ops.probe_gpus(probe_cluster)
        nodes = init_ops.with_probed_nproc(cluster, probes)
        for result in probes:
            if result.count is None:
                code = EXIT_NODE_NOT_READY
                print(f"warning: {result.error}", file=sys.stderr)
                comments[result.host] = "not probed: unreachable"
            else:
                comments[result.host] = init_ops.describe_gpus(result)
    text = init_ops.render(
        nodes, python=python, workdir=workdir, ssh_config=ssh_config, comments=comments
    )
    init_ops.write_cluster_file(output, text, force=force)
    listed = nodes_in_words((n.host, n.nproc) for n in nodes)
    print(f"wrote {output}: {len(nodes)} node(s) [{listed}]")
    if code != EXIT_OK:
        print("nproc of the nodes that could not be probed is left to launch time", file=sys.stderr)
    print("next: `herd ssh-setup` (keys), then `herd doctor`")
    return code


# ---------------------------------------------------------------------------------------------
# ssh-setup


@app.command("ssh-setup", cls=HerdCommand)
def ssh_setup_command(
    config: str = typer.Option(None, "-c", "--config", help=CLUSTER_HELP),
    hosts: str = typer.Option(None, "-H", "--hosts", help=HOSTS_HELP),
    nodes: str = typer.Option(None, "--nodes", help=NODES_HELP),
    key: str = typer.Option(None, "--key", help="Private key to install (default: ssh's own)."),
) -> int:
    """Create a key if you have none, install it on every node, verify key login everywhere.

    Nodes that refuse the key get it appended to ~/.ssh/authorized_keys; ssh asks for that
    node's password on the terminal. New host keys are recorded (accept-new); a changed host
    key stops that node.
    """
    from ..ops import sshsetup

    cluster = cluster_for(config, hosts, nodes=nodes)
    private, created, results = sshsetup.setup(cluster, key=key)
    table = result_table(("HOST", "KEY", "HOST KEY", "LOGIN"))
    for result in results:
        table.add_row(result.host, result.key, result.host_key, result.login)
    console().print(table)
    failed = [r for r in results if not r.ok]
    for result in failed:
        print(f"  {result.host}: fix: {result.fix}")
    key_note = "created" if created else "used"
    if failed:
        print(
            f"{len(failed)} of {len(results)} node(s) cannot be reached with key login "
            f"({key_note} {private})",
            file=sys.stderr,
        )
        return EXIT_NODE_NOT_READY
    print(f"key login works on all {len(results)} node(s) ({key_note} {private})")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# exec


@app.command(
    "exec",
    cls=HerdCommand,
    options_metavar="[OPTIONS] -- COMMAND...",
    context_settings=RUNS_SOMETHING,
)
def exec_command(
    ctx: typer.Context,
    config: str = typer.Option(None, "-c", "--config", help=CLUSTER_HELP),
    hosts: str = typer.Option(None, "-H", "--hosts", help=HOSTS_HELP),
    nodes: str = typer.Option(None, "--nodes", help=NODES_HELP),
    timeout: float = typer.Option(None, "--timeout", min=0.1, help="Seconds before it is ended."),
    as_json: bool = typer.Option(False, "--json", help="Results (with output) as JSON."),
) -> int:
    """Run -- COMMAND... on every node in parallel; lines prefixed by host, then a table.

    The words are joined with spaces and run by each node's shell, as `ssh HOST COMMAND`
    would, in the cluster's workdir (else in this directory where the node has it, else in
    the home directory). Exit 0 when every node succeeded, 1 when one failed, 3 when one was
    unreachable. Example: herd exec -- pip install -r requirements.txt
    """
    from ..ops.fanout import run_everywhere

    words = list(ctx.args)
    if not words:
        raise UsageError("no command given", "herd exec -- COMMAND [ARGS...]")
    command = " ".join(words)
    cluster = cluster_for(config, hosts, nodes=nodes)
    width = max(len(n.host) for n in cluster.nodes)
    colors = {n.host: _COLORS[i % len(_COLORS)] for i, n in enumerate(cluster.nodes)}

    def on_line(host: str, stream: str, text: str) -> None:
        target = sys.stderr if stream == "e" else sys.stdout
        label = host.ljust(width)
        if target.isatty():
            label = f"\x1b[{colors[host]}m{label}\x1b[0m"
        target.write(f"{label} | {text}\n")
        target.flush()

    results = run_everywhere(
        cluster, command, timeout=timeout, on_line=None if as_json else on_line, capture=as_json
    )
    if as_json:
        print(
            json.dumps(
                {
                    "command": command,
                    "ok": all(r.ok for r in results),
                    "results": [
                        {
                            "host": r.host,
                            "status": r.status,
                            "exit_code": r.exit_code,
                            "duration_s": round(r.duration, 3),
                            "detail": r.detail,
                            "stdout": r.stdout,
                            "stderr": r.stderr,
                        }
                        for r in results
                    ],
                },
                indent=2,
            )
        )
    else:
        table = result_table(("HOST", "EXIT", "TIME", "RESULT"), right=("EXIT", "TIME"))
        for r in results:
            exit_text = "-" if r.exit_code is None else str(r.exit_code)
            table.add_row(r.host, exit_text, f"{r.duration:.1f}s", r.detail or r.status)
        console().print(table)
    if any(r.status in ("failed", "timeout") for r in results):
        return EXIT_JOB_FAILED
    if any(r.status == "interrupted" for r in results):
        return 130
    if any(not r.ok for r in results):
        return EXIT_NODE_NOT_READY
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# sync


@app.command("sync", cls=HerdCommand)
def sync_command(
    path: Annotated[Path, typer.Argument(help="Project directory to copy (default: .).")] = HERE,
    config: str = typer.Option(None, "-c", "--config", help=CLUSTER_HELP),
    hosts: str = typer.Option(None, "-H", "--hosts", help=HOSTS_HELP),
    nodes: str = typer.Option(None, "--nodes", help=NODES_HELP),
    exclude: Annotated[
        list[str] | None, typer.Option("--exclude", help="rsync pattern to leave out (repeat).")
    ] = None,
    delete: bool = typer.Option(
        False,
        "--delete",
        help="Delete files on the nodes that are not here (never excluded or ignored ones).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Results as JSON."),
) -> int:
    """Copy PATH into each node's workdir with rsync, in parallel; .gitignore is honoured.

    Nodes that already see PATH (shared filesystem) are skipped; nodes sharing one filesystem
    are copied to once. A repeat sends only what changed. Example: herd sync . --exclude data/
    """
    from ..ops.sync import Syncer, destination

    cluster = cluster_for(config, hosts, nodes=nodes)
    syncer = Syncer(cluster, path, excludes=exclude or [], delete=delete)
    dest = destination(cluster, path)
    show = not as_json and sys.stderr.isatty()
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%  {task.fields[sent]}"),
        console=console(stderr=True),
        transient=True,
        disable=not show,
    )
    tasks: dict[str, TaskID] = {}

    def on_progress(host: str, percent: int, done: int) -> None:
        if host not in tasks:
            tasks[host] = progress.add_task(host, total=100, sent="")
        progress.update(tasks[host], completed=percent, sent=human_bytes(done))

    syncer.on_progress = on_progress
    if not as_json:
        print(f"syncing {path.resolve()}/ -> {dest} on {len(cluster.nodes)} node(s)", flush=True)
    with progress:
        results = asyncio.run(syncer.run())
    if as_json:
        print(
            json.dumps(
                {
                    "source": str(path.resolve()),
                    "destination": dest,
                    "ok": all(r.ok for r in results),
                    "results": [
                        {
                            "host": r.host,
                            "status": r.status,
                            "bytes_sent": r.bytes_sent,
                            "files": r.files,
                            "duration_s": round(r.duration, 3),
                            "detail": r.detail,
                        }
                        for r in results
                    ],
                },
                indent=2,
            )
        )
    else:
        table = result_table(
            ("HOST", "RESULT", "SENT", "FILES", "TIME"), right=("SENT", "FILES", "TIME")
        )
        for r in results:
            copied = r.status == "copied"
            table.add_row(
                r.host,
                r.status + (f": {r.detail}" if r.detail else ""),
                human_bytes(r.bytes_sent) if copied else "-",
                str(r.files) if copied else "-",
                f"{r.duration:.1f}s" if copied else "-",
            )
        console().print(table)
    if any(r.status == "unreachable" for r in results):
        return EXIT_NODE_NOT_READY
    return EXIT_OK if all(r.ok for r in results) else EXIT_JOB_FAILED

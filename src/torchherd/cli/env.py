"""`herd env sync|status|show|use|rm`: one Python environment, the same on every node."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import typer

from ..errors import EXIT_INTERRUPTED, EXIT_NODE_NOT_READY, EXIT_OK
from .app import CLUSTER_HELP, HOSTS_HELP, NODES_HELP, app
from .common import cluster_for
from .ops import console
from .parsing import HerdCommand, HerdGroup
from .tables import result_table

env_app = typer.Typer(
    help="One Python environment, named by a hash, built the same on every node.\n\n"
    "The environment is a uv.lock or pinned requirements file (--lock), else this "
    "environment. `herd env sync` sends each node only the wheels it lacks (nodes need no "
    "network, only python3) and installs them with uv into ROOT/HASH (node-local), switching "
    "ROOT/current once the node's own python recomputes the hash. Point the cluster's python "
    "at ROOT/current/bin/python.",
    no_args_is_help=True,
    cls=HerdGroup,
)
app.add_typer(env_app, name="env")

LOCK_HELP = (
    "uv.lock or pinned requirements file; default: env_lock of the cluster file, else "
    "./uv.lock, else this environment."
)
ROOT_HELP = (
    "Node-local folder for environments and caches; default: env_root of the cluster file, "
    "else inside a Slurm/PBS allocation $TMPDIR (or /tmp)/herd-envs, else ~/.herd/envs."
)
JSON_HELP = "Print the result as JSON on stdout (no table)."
PYTHON_HELP = "Interpreter on the nodes that runs herd's node side (only python3 is needed)."


def _runner(
    config: str | None,
    hosts: str | None,
    nodes: str | None,
    root: str | None,
    node_python: str,
    quiet: bool,
    relay_above: int | None = None,
):  # noqa: ANN202 - EnvSync, imported lazily
    """The run against the cluster; ``root`` None: the cluster's env_root, else node-local
    scratch inside an allocation, else ~/.herd/envs (envs.at_launch.root_for)."""
    from ..envs.at_launch import root_for
    from ..envs.ship import RELAY_ABOVE, EnvSync

    cluster = cluster_for(config, hosts, nodes=nodes)

    def progress(host: str, what: str) -> None:
        if not quiet:
            print(f"{host}: {what}", file=sys.stderr, flush=True)

    return EnvSync(
        cluster,
        root=root or root_for(cluster),
        node_python=node_python,
        progress=progress,
        relay_above=RELAY_ABOVE if relay_above is None else relay_above,
    )


def _target(lock: Path | None, cluster=None):  # noqa: ANN001, ANN202
    """--lock, else the cluster file's env_lock, else ./uv.lock, else this environment."""
    from ..envs.identity import choose

    if lock is None and cluster is not None and cluster.env_lock:
        lock = Path(cluster.env_lock)
    return choose(lock, Path.cwd())


def _print_results(results: list, as_json: bool, extra: dict) -> None:  # type: ignore[type-arg]
    if as_json:
        print(json.dumps({**extra, "nodes": [r.as_json() for r in results]}, indent=2))
        return
    table = result_table(("HOST", "STATE", "BEFORE", "NOW", "SENT", "PLATFORM"), right=("SENT",))
    for r in results:
        sent = f"{r.bytes_sent / (1 << 20):.1f} MiB" if r.bytes_sent else "-"
        table.add_row(r.host, r.state, r.before or "-", r.after or "-", sent, r.platform)
    console().print(table)
    for r in results:
        if r.detail:
            print(f"  {r.host}: {r.detail}")


@env_app.command("sync", cls=HerdCommand)
def sync_command(
    lock: Path = typer.Option(None, "--lock", help=LOCK_HELP),
    wheels: list[Path] = typer.Option(
        [],
        "--wheels",
        help="Folder of wheels to take first (repeatable; default: env_wheels of the cluster "
        "file); what is missing is fetched once with pip.",
    ),
    root: str = typer.Option(None, "--root", help=ROOT_HELP),
    node_python: str = typer.Option("python3", "--node-python", help=PYTHON_HELP),
    config: str = typer.Option(None, "-c", "--config", help=CLUSTER_HELP),
    hosts: str = typer.Option(None, "-H", "--hosts", help=HOSTS_HELP),
    nodes: str = typer.Option(None, "--nodes", help=NODES_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    relay_above: int = typer.Option(
        None,
        "--relay-above",
        min=0,
        help="With more nodes to sync than this (default 16), nodes that lack the same wheels "
        "pass them on to each other (TCP between the nodes), so the launcher sends one copy.",
    ),
) -> int:
    """Make every node's environment the one of --lock (or this one): only what a node lacks
    travels; a node keeps its previous environment until the new one is built and verified.

    Example: herd env sync --lock requirements.txt --wheels ./wheels --root /local/herd
    """
    runner = _runner(config, hosts, nodes, root, node_python, as_json, relay_above)
    target = _target(lock, runner.cluster)
    wheels = wheels or [Path(f) for f in runner.cluster.env_wheels]
    root = runner.root
    if not as_json:
        print(
            f"environment {target.hash} ({len(target.packages)} packages, {target.source})",
            file=sys.stderr,
        )
    try:
        results = asyncio.run(runner.sync(target, list(wheels)))
    except KeyboardInterrupt:
        print(
            "herd env sync interrupted: a node switches only once its new environment is "
            "complete and verified, so every node not yet switched keeps its previous one "
            "(`herd env status` shows each node's)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    _print_results(results, as_json, {"hash": target.hash})
    bad = [r for r in results if r.state in ("failed", "refused")]
    if not as_json:
        if bad:
            print(
                f"{len(bad)} of {len(results)} node(s) not synced; run `herd env sync` again "
                "once fixed (only what is missing travels)",
                file=sys.stderr,
            )
        else:
            print(f'every node runs {target.hash}: python = "{root}/current/bin/python"')
    return EXIT_NODE_NOT_READY if bad else EXIT_OK


@env_app.command("status", cls=HerdCommand)
def status_command(
    lock: Path = typer.Option(None, "--lock", help=LOCK_HELP),
    root: str = typer.Option(None, "--root", help=ROOT_HELP),
    node_python: str = typer.Option("python3", "--node-python", help=PYTHON_HELP),
    config: str = typer.Option(None, "-c", "--config", help=CLUSTER_HELP),
    hosts: str = typer.Option(None, "-H", "--hosts", help=HOSTS_HELP),
    nodes: str = typer.Option(None, "--nodes", help=NODES_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> int:
    """Each node's current environment against --lock (or this one): the packages that differ,
    and the command that fixes them. Exit 3 when a node differs."""
    runner = _runner(config, hosts, nodes, root, node_python, True)
    target = _target(lock, runner.cluster)
    root = runner.root
    results = asyncio.run(runner.status(target))
    _print_results(results, as_json, {"hash": target.hash})
    differ = [r for r in results if r.state != "same"]
    if not as_json:
        for r in differ:
            for line in r.changes[:20]:
                print(f"  {r.host}: {line}")
        if differ:
            hosts_text = ",".join(r.host for r in differ)
            lock_text = f" --lock {lock}" if lock else ""
            print(
                f"fix: herd env sync{lock_text} --root {root} --nodes {hosts_text}", file=sys.stderr
            )
    return EXIT_NODE_NOT_READY if differ else EXIT_OK


@env_app.command("show", cls=HerdCommand)
def show_command(
    lock: Path = typer.Option(None, "--lock", help=LOCK_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> int:
    """The environment herd would sync, here: its hash, source and packages (no node asked)."""
    target = _target(lock)
    if as_json:
        print(
            json.dumps(
                {
                    "hash": target.hash,
                    "source": target.source,
                    "python": target.python_version,
                    "packages": target.packages,
                },
                indent=2,
            )
        )
        return EXIT_OK
    print(
        f"{target.hash}  python {target.python_version}, {len(target.packages)} packages, "
        f"from {target.source}"
    )
    for name, version in sorted(target.packages.items()):
        print(f"  {name}=={version}")
    return EXIT_OK


def _each(
    action: str,
    hash_: str,
    root: str,
    node_python: str,
    config: str | None,
    hosts: str | None,
    nodes: str | None,
    as_json: bool,
) -> int:
    runner = _runner(config, hosts, nodes, root, node_python, True)
    results = asyncio.run(runner.each_action(action, hash=hash_))
    if as_json:
        print(json.dumps([r.as_json() for r in results], indent=2))
    else:
        for r in results:
            print(f"{r.host}: {r.state} {r.detail}")
    return EXIT_NODE_NOT_READY if any(r.state == "failed" for r in results) else EXIT_OK


@env_app.command("use", cls=HerdCommand)
def use_command(
    env_hash: str = typer.Argument(..., metavar="HASH", help="An environment built before."),
    root: str = typer.Option(None, "--root", help=ROOT_HELP),
    node_python: str = typer.Option("python3", "--node-python", help=PYTHON_HELP),
    config: str = typer.Option(None, "-c", "--config", help=CLUSTER_HELP),
    hosts: str = typer.Option(None, "-H", "--hosts", help=HOSTS_HELP),
    nodes: str = typer.Option(None, "--nodes", help=NODES_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> int:
    """Switch every node back (or forth) to an environment it keeps: instant, nothing built."""
    return _each("use", env_hash, root, node_python, config, hosts, nodes, as_json)


@env_app.command("rm", cls=HerdCommand)
def rm_command(
    env_hash: str = typer.Argument(..., metavar="HASH", help="The environment to remove."),
    root: str = typer.Option(None, "--root", help=ROOT_HELP),
    node_python: str = typer.Option("python3", "--node-python", help=PYTHON_HELP),
    config: str = typer.Option(None, "-c", "--config", help=CLUSTER_HELP),
    hosts: str = typer.Option(None, "-H", "--hosts", help=HOSTS_HELP),
    nodes: str = typer.Option(None, "--nodes", help=NODES_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> int:
    """Remove an environment from every node (never the current one; its cached wheels stay)."""
    return _each("rm", env_hash, root, node_python, config, hosts, nodes, as_json)

"""`herd launch`: run a training script with torchrun on every node."""

from __future__ import annotations

import errno
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from ..plan import JobSpec, LaunchPlan
    from ..spec import ClusterSpec

from ..errors import EXIT_SAVED, UsageError
from ..files import private_dir
from .app import CLUSTER_HELP, HOSTS_HELP, NODES_HELP, app
from .common import cluster_for
from .parsing import RUNS_SOMETHING, TORCHRUN_OTHERWISE, LaunchCommand
from .state import state

# An environment variable's name, as POSIX shells accept it.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@app.command("launch", cls=LaunchCommand, context_settings=RUNS_SOMETHING)
def launch_command(
    ctx: typer.Context,
    script: str = typer.Argument(
        None,
        metavar="SCRIPT [ARGS]...",
        help="Training script (or module with -m), then its arguments.",
        show_default=False,
    ),
    config: str = typer.Option(None, "-c", "--config", help=CLUSTER_HELP),
    hosts: str = typer.Option(None, "-H", "--hosts", help=HOSTS_HELP),
    nodes: str = typer.Option(None, "--nodes", help=NODES_HELP),
    module: str = typer.Option(
        None,
        "-m",
        "--module",
        help="Run a module (like python -m) instead of a script; what follows is its own.",
    ),
    nproc: int = typer.Option(
        None,
        "--nproc",
        min=1,
        help="Workers per node (default: GPUs, or 1). torchrun's --nproc-per-node also works.",
    ),
    no_python: bool = typer.Option(
        False,
        "--no-python",
        help="Run SCRIPT as a program, not with python (like torchrun --no-python): a path "
        "(./run.sh) or a command on the nodes' PATH.",
    ),
    env: list[str] = typer.Option(
        None,
        "--env",
        "-e",
        metavar="KEY=VALUE",
        help="Set this variable for the workers on every node (repeatable); wins over "
        "\\[cluster] env. Secrets belong in env_file, not on a command line.",
    ),
    name: str = typer.Option(
        None, "--name", help="A name for the job: shown by herd ps, accepted by logs/stop/report."
    ),
    ranks: str = typer.Option(
        None,
        "--ranks",
        metavar="RANKS",
        help="Show only these global ranks live: 0,3-5, or all. Default: every rank, but on "
        "more than 16 nodes rank 0 and every rank's stderr. Every rank's output is still kept "
        "(herd logs JOB --rank R).",
    ),
    max_restarts: int = typer.Option(
        0,
        "--max-restarts",
        min=0,
        help="Restarts of the whole job (every node, fresh rendezvous) after a failure, "
        "a lost node or a hang. While restarts are left, each node keeps the next attempt's "
        "torchrun wrapper warm (torch imported) once the job steps.",
    ),
    min_nodes: int = typer.Option(
        None,
        "--min-nodes",
        min=1,
        help="On a restart, go on without nodes that stopped answering while at least this "
        "many remain (default: \\[cluster] min_nodes, else every node is needed).",
    ),
    hang_timeout: float = typer.Option(
        None,
        "--hang-timeout",
        min=0,
        help="A plain limit: seconds without progress from any rank (output lines, "
        "torchherd.progress beats and phases) that make a hang, whatever else herd sees; "
        "0 turns the hang watch off. Default: none; hangs are judged by looking at the ranks "
        "once the job goes quiet (a stopped or blocked rank, nobody working). Once some ranks "
        "finished, a rank still running this long after them never exited: the job ends as "
        "finished (exit 6), never restarted.",
    ),
    spares: int = typer.Option(
        0,
        "--spares",
        min=0,
        help="The last N hosts of the cluster (a hostfile, -H, an allocation) are hot spares: "
        "checked and warmed, no rank; a lost node's place goes to one, the world size stays.",
    ),
    replica_groups: bool = typer.Option(
        False,
        "--replica-groups",
        help="Train through a lost node: every node runs as its own torchft replica group "
        "(needs pip install 'torchherd\\[ft]' on the nodes). herd runs torchft's lighthouse "
        "on the first node and restarts it if it dies; a group that dies is restarted alone, "
        "on its node once it answers, and heals from the live groups while they go on "
        "stepping. --max-restarts counts per group. See README, When things fail.",
    ),
    swap_slow: float = typer.Option(
        None,
        "--swap-slow",
        min=0,
        help="Swap out a node named slow that is still the slowest SECONDS later: the workers "
        "save and stop, and the next attempt runs with a hot spare in its place (or without it "
        "where --min-nodes allows); the node is left out like a lost one and comes back as a "
        "spare once it passes a returning node's checks. Off by default.",
    ),
    group_nodes: int = typer.Option(
        1,
        "--group-nodes",
        min=1,
        help="With --replica-groups: nodes per replica group (K nodes in plan order run as one "
        "torchrun; the node count must divide by K). A group is lost, restarted and healed as "
        "a whole; a free spare takes a lost node's place in it.",
    ),
    crash_loop: int = typer.Option(
        3,
        "--crash-loop",
        min=1,
        help="Give up (exit 4) after this many restarts in a row without step progress.",
    ),
    log_dir: Path = typer.Option(
        None, "--log-dir", help="Per-rank logs here (default: ~/.herd/jobs/<job-id>/)."
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Print what would run on each node (secrets masked) and herd's restart budget; "
        "start nothing. Like a launch it probes every node over ssh (address, GPUs, a free "
        "port); nodes it cannot reach get placeholder addresses, and a note says so.",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="With --dry-run: the plan as JSON (for scripts)."
    ),
    verbose: bool = typer.Option(
        False,
        "-v",
        "--verbose",
        help="Once the job's first step is made, print where its start went, phase by phase "
        "(ssh connect, agent start, probe, plan, wrapper warm, rendezvous, script start, "
        "process-group init, first step), with the slowest node of each; the same for every "
        "restart. The job record and `herd report` keep it either way.",
    ),
    no_preflight: bool = typer.Option(
        False, "--no-preflight", help="Start even when a fast check fails."
    ),
    tree_above: int = typer.Option(
        None,
        "--tree-above",
        min=1,
        help="Over ssh, with more nodes than this, connect to a few inner nodes only (the "
        "last, one per 33 nodes) and start the other nodes' agents through them (each "
        "node still links straight back here, over plain TCP; -v says which node went "
        "through which). Default: \\[cluster] tree_above; off unless set.",
    ),
    detach: bool = typer.Option(
        False,
        "--detach",
        help="Return once every node has started; the job runs on (herd logs/ps/stop JOB).",
    ),
    grace: float = typer.Option(
        10.0, "--grace", min=0, help="Seconds workers get to exit after SIGTERM."
    ),
    max_requeues: int = typer.Option(
        0,
        "--max-requeues",
        min=0,
        help="Inside Slurm/PBS: after the job saved at a time limit (SIGUSR1), requeue it "
        "(Slurm) or submit it again after this one (PBS) up to this many times.",
    ),
    env_sync: bool = typer.Option(
        False,
        "--env-sync",
        help="Run the job in one Python environment on every node: the probe compares each "
        "node's environment hash with env_lock's (else ./uv.lock, else this environment) and "
        "syncs only the nodes that differ, as `herd env sync` would, before starting "
        "(\\[cluster] env_sync = true does the same).",
    ),
    time_grace: float = typer.Option(
        120.0,
        "--time-grace",
        min=1,
        help="Seconds between the time-limit warning and the end: the workers get this less "
        "--grace and 10 s to save. Inside PBS herd warns itself this long before the "
        "walltime; under Slurm give #SBATCH --signal=B:USR1@SECONDS the same value.",
    ),
) -> int:
    """Run SCRIPT [ARGS...] (or -m MODULE [ARGS...]) with torchrun on every node.

    Every worker's output is prefixed with host:rank; per-rank logs are kept.
    Ctrl-C stops the job on every node. Inside a Slurm or PBS allocation the nodes are the
    allocated ones (one agent per node).
    A node that stops answering for 10 s is lost; a quiet job is looked at and stopped as hung
    only on evidence (a stopped or blocked rank, nobody working), after herd takes every
    worker's stacks (herd logs JOB --stacks).

    herd's options go before SCRIPT; everything after it is the script's. torchrun's
    spellings of the options herd shares with it work too (--nproc-per-node, --max_restarts).

    Exit: 0 success, 1 job failed, 2 usage/config, 3 node not ready, 4 crash loop,
    5 saved for a time limit, 6 finished but a rank never exited, 130 interrupted.
    """
    # Here, not at the top: every herd command would pay for the launcher's imports.
    from ..launcher.launch import LaunchOptions, launch
    from ..plan import JobSpec, LaunchPlan
    from ..scheduler.requeue import pbs_deadline, requeue_after_save

    args = list(ctx.args)
    worker_env = parse_env(env or [])
    shown_ranks = parse_ranks(ranks)
    if detach and max_restarts:
        raise UsageError(
            "--max-restarts needs an attached launcher: herd restarts the job on every node, "
            "and a detached job has no launcher watching it",
            "drop --detach (run herd in tmux or screen to survive a closed terminal), "
            "or drop --max-restarts",
        )
    if detach and replica_groups:
        raise UsageError(
            "--replica-groups needs an attached launcher: herd restarts the lighthouse and "
            "each group that dies",
            "drop --detach (run herd in tmux or screen), or drop --replica-groups",
        )
    if group_nodes > 1 and not replica_groups:
        raise UsageError(
            "--group-nodes goes with --replica-groups (the nodes of one replica group)",
            "add --replica-groups, or drop --group-nodes",
        )
    if as_json and not dry_run:
        raise UsageError(
            "--json goes with --dry-run (the plan)",
            "add --dry-run; a running job's state is in `herd ps --json`",
        )
    if module and no_python:
        raise UsageError("-m and --no-python do not go together", "drop one of them")
    cluster = cluster_for(config, hosts, nodes=nodes, nproc=nproc)
    if env_sync:
        cluster = cluster.model_copy(update={"env_sync": True})
    if tree_above is not None:
        cluster = cluster.model_copy(update={"tree_above": tree_above})
    check_single_node(cluster)
    if module:
        if script is not None:
            args.insert(0, script)
        entry, is_module = (module, *args), True
    else:
        if script is None:
            raise UsageError(
                "no training script given", "herd launch train.py [ARGS...], or -m MODULE"
            )
        # Without a workdir the job runs in this directory on every node: check here. With
        # one, the script is a path on the nodes, and torchrun there names it if it is missing.
        # A --no-python program without a slash is looked for on the nodes' PATH instead.
        local_file = not no_python or "/" in script
        if local_file and not cluster.workdir and not Path(script).exists():
            what = "program" if no_python else "training script"
            raise UsageError(
                f"{what} {script} not found in {os.getcwd()}",
                "give its path relative to the working directory "
                "(herd sync copies it to the nodes)",
            )
        entry, is_module = (script, *args), False
    warn_misplaced_options(entry)
    if log_dir is not None:
        # The job record keeps this path, and `herd logs` reads it from any directory.
        log_dir = log_dir.expanduser().absolute()
        check_log_dir(log_dir, create=not dry_run)
    job = JobSpec(
        entry=tuple(entry),
        module=is_module,
        no_python=no_python,
        nproc=nproc,
        max_restarts=max_restarts,
        min_nodes=min_nodes,
        crash_loop=crash_loop,
        grace=grace,
        spares=spares,
        env=worker_env,
        name=check_name(name),
        replica_groups=replica_groups,
        group_nodes=group_nodes,
        swap_slow=swap_slow,
    )
    options = LaunchOptions(
        dry_run=dry_run,
        ranks=shown_ranks,
        every_rank=every_rank_asked(ranks),
        log_dir=log_dir,
        preflight=not no_preflight,
        detach=detach,
        save_within=save_window(time_grace, grace),
        hang_timeout=hang_timeout,
        verbose=verbose,
    )
    deadline = None if dry_run or detach else pbs_deadline(cluster, time_grace)
    try:
        result = launch(cluster, job, options)
    finally:
        if deadline is not None:
            deadline.cancel()
    if isinstance(result, LaunchPlan):
        budget = restart_budget(job, cluster.min_nodes)
        if as_json:
            print(json.dumps(plan_json(result, budget), indent=2))
        else:
            # the budget with the job's facts, above the nodes' blocks
            head, _, nodes_text = result.render().partition("\n\n")
            sys.stdout.write(f"{head}\n{budget['said']}\n\n{nodes_text}\n")
        return 0
    if result.exit_code == EXIT_SAVED:
        print(requeue_after_save(cluster, max_requeues), file=sys.stderr, flush=True)
    return result.exit_code


# Seconds kept at the end of a time-limit warning after the save window: herd stops what
# still runs (SIGTERM, the grace period, SIGKILL) and requeues the job within them.
SAVE_MARGIN = 10.0


def save_window(warning: float, grace: float) -> float:
    """Seconds the workers get to save after a time-limit warning ``warning`` seconds before
    the end: the warning less the stop (``grace``) and a margin, never under 5 s."""
    return max(5.0, warning - grace - SAVE_MARGIN)


def parse_env(pairs: list[str]) -> dict[str, str]:
    """--env KEY=VALUE (repeatable) as a dict; a malformed pair is a usage error."""
    env: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not ENV_NAME.fullmatch(key):
            raise UsageError(
                f"--env {pair!r} is not KEY=VALUE with a variable name as KEY",
                "write it like --env NCCL_DEBUG=INFO (letters, digits and _ in the name)",
            )
        env[key] = value
    return env


def parse_ranks(text: str | None) -> frozenset[int] | None:
    """--ranks "0,3-5" -> {0, 3, 4, 5}; "all" or nothing -> None (every rank)."""
    if text is None or text.strip().lower() == "all":
        return None
    ranks: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match or (match[2] is not None and int(match[2]) < int(match[1])):
            raise UsageError(
                f"--ranks {text!r}: cannot read {part.strip()!r} as a rank or a range",
                "write global ranks like --ranks 0 or --ranks 0,3-5 (or --ranks all)",
            )
        first = int(match[1])
        ranks.update(range(first, int(match[2] or first) + 1))
    return frozenset(ranks)


def every_rank_asked(text: str | None) -> bool:
    """--ranks all, said outright: every rank's lines reach the launcher, even on a job of
    more than 16 nodes, where the default is rank 0's and every stderr line."""
    return text is not None and text.strip().lower() == "all"


def check_name(name: str | None) -> str | None:
    """A job name is shown in tables and matched by logs/stop: printable, one line, short."""
    if name is None:
        return None
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
        raise UsageError(
            f"--name {name!r}: a job name is 1-64 letters, digits, '.', '_' or '-', starting "
            "with a letter or digit",
            "write it like --name gpt-small-lr3e-4",
        )
    return name


def check_log_dir(path: Path, *, create: bool = True) -> None:
    """Create --log-dir (0700) and write a file in it now, so a directory that cannot take the
    logs is an error before any node starts, not a traceback after. A dry run (``create``
    False) makes nothing, but refuses what the launch would: a file in the way, or a folder
    that this user cannot write in."""
    try:
        if not create:
            _would_take_logs(path)
            return
        private_dir(path)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise UsageError(
            f"cannot write logs to --log-dir {path}: {exc.strerror or exc}",
            "give a directory you can write to, or leave --log-dir out "
            "(logs then go to ~/.herd/jobs/<job-id>/)",
        ) from None


def _would_take_logs(path: Path) -> None:
    """Raise the OSError making ``path`` as a log directory would meet (nothing is made)."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(existing))
    # A file made and removed at once: os.access says yes to root on a read-only filesystem
    # or in /proc, where making the folder would fail.
    with tempfile.TemporaryFile(dir=existing):
        pass


def check_single_node(cluster: ClusterSpec) -> None:
    """torchrun's --standalone or --nnodes 1, typed out of habit: exactly what herd does with
    no cluster (this machine alone), refused where a cluster names other nodes."""
    asked, state.single_node = state.single_node, None
    if asked is None or (cluster.transport == "local" and len(cluster.nodes) == 1):
        return
    what, fix = TORCHRUN_OTHERWISE[asked.split()[0]]
    raise UsageError(
        f"{asked} is torchrun's option, and the nodes come from {cluster.source}: {what}", fix
    )


def restart_budget(job: JobSpec, cluster_min_nodes: int | None) -> dict[str, object]:
    """herd's own restart budget, which a dry run shows beside torchrun's --max-restarts=0
    (herd restarts the whole job; torchrun restarts nothing by itself)."""
    min_nodes = job.min_nodes if job.min_nodes is not None else cluster_min_nodes
    if job.max_restarts:
        said = (
            f"restarts: herd restarts the whole job up to {job.max_restarts} time(s) after a "
            "failure, a lost node or a hang (--max-restarts), and gives up after "
            f"{job.crash_loop} in a row without step progress (--crash-loop); "
            + (
                f"a restart goes on with at least {min_nodes} node(s) (--min-nodes)"
                if min_nodes
                else "a restart needs every node (--min-nodes M to go on without lost ones)"
            )
        )
    else:
        said = "restarts: none; the job fails at its first failure (--max-restarts N)"
    said += ". torchrun's --max-restarts=0 is on purpose: herd restarts, not torchrun."
    return {
        "max_restarts": job.max_restarts,
        "crash_loop": job.crash_loop,
        "min_nodes": min_nodes,
        "said": said,
    }


def plan_json(plan: LaunchPlan, budget: dict[str, object]) -> dict[str, object]:
    """The plan as `herd launch --dry-run --json` prints it (secrets masked)."""
    from ..redact import redact_argv, redact_env

    secrets = plan.secret_env.values()
    return {
        "job_id": plan.job_id,
        "world_size": plan.world_size,
        "rendezvous": plan.rdzv_endpoint,
        "workdir": plan.workdir,
        "restarts": {k: v for k, v in budget.items() if k != "said"},
        "warnings": list(plan.warnings),
        "notes": list(plan.notes),
        "secrets": sorted(plan.secret_env),
        "nodes": [
            {
                "host": node.host,
                "rendezvous_host": node.is_host,
                "workers": node.nproc,
                "address": node.local_addr,
                "interface": node.iface,
                "env": dict(redact_env(node.env, secrets)),
                "command": list(redact_argv(node.argv, secrets)),
            }
            for node in plan.nodes
        ],
    }


# herd's options that a script seldom has of its own: after the script they are the script's,
# which is seldom what was meant (`herd launch train.py --nproc 2` runs at world size 1).
HERD_ONLY = (
    "--nproc", "--nproc-per-node", "--nproc_per_node", "--max-restarts", "--max_restarts",
    "--hosts", "--nnodes", "--min-nodes", "--spares", "--hang-timeout", "--dry-run", "--detach",
    "--crash-loop",
)  # fmt: skip


def warn_misplaced_options(entry: tuple[str, ...] | list[str]) -> None:
    """Say on stderr when the script's arguments hold one of herd's own options: they go to
    the script as typed (herd never takes them back), but a user who meant herd's hears of it."""
    script, *args = entry
    for word in args:
        if word == "--":
            return
        name = word.split("=", 1)[0]
        if name in HERD_ONLY:
            print(
                f"herd: warning: {name} comes after {script}, so it goes to the script, not to "
                f"herd; herd's options go before the script (herd launch {name} ... {script})",
                file=sys.stderr,
            )

"""The launcher of a simulated cluster: ``herd launch`` on it, as one process of its own.

    python -m tests.simcluster.launcher ROOT [--seconds S] [--hang-timeout S] [--max-restarts N]
                                             [--min-nodes M] [--grace S] [--ranks R]
                                             [--tree-above N]

It runs herd's own launch (torchherd.launcher.launch.launch: connect, probe, preflight, plan,
supervise, teardown, the console and the job's logs) on the cluster built under ROOT
(cluster.py), through the SimulatedHosts transport (with --tree-above, through herd's tree
of agents above N nodes, as ``herd launch --tree-above N`` over ssh); the exit code is herd
launch's.
A benchmark measures this process alone: the node agents are its children, not part of it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchherd.cli.launch import every_rank_asked, parse_ranks
from torchherd.errors import HerdError
from torchherd.launcher.launch import LaunchOptions, launch
from torchherd.results import RunResult

from .cluster import SimCluster
from .forkserver import requests_fifo
from .transport import SimulatedHosts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("root", type=Path, help="the simulated cluster's directory")
    parser.add_argument("--seconds", type=float, default=0, help="job length; 0: until stopped")
    parser.add_argument("--hang-timeout", type=float, default=None)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--min-nodes", type=int, default=None)
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("--ranks", default=None, help="herd launch's --ranks")
    parser.add_argument("--tree-above", type=int, default=None, help="herd launch's")
    args = parser.parse_args(argv)
    sim = SimCluster.open(args.root)
    cluster = sim.spec().model_copy(update={"tree_above": args.tree_above})
    job = sim.job(
        args.seconds, max_restarts=args.max_restarts, min_nodes=args.min_nodes, grace=args.grace
    )
    options = LaunchOptions(
        hang_timeout=args.hang_timeout,
        color=False,
        ranks=parse_ranks(args.ranks),
        every_rank=every_rank_asked(args.ranks),
    )
    # The agents' fork server: the caller's, when it started one (a benchmark, before its
    # clock starts), else this launcher's own.
    server = None if requests_fifo(sim.root).is_fifo() else sim.start_forkserver()
    try:
        result = launch(cluster, job, options, transport=SimulatedHosts(cluster, tree=True))
    except HerdError as exc:
        print(f"error: {exc.message}\n  fix: {exc.remedy}", file=sys.stderr)
        return exc.exit_code
    finally:
        if server is not None:
            server.terminate()  # it ends once the agents it forked have
    assert isinstance(result, RunResult)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m torchherd.agent.elastic [torchrun arguments]`: torchrun, with a failure record.

This is torchrun itself (torch.distributed.run), with three additions the node agent needs:
the workers get herd's exit wait (``exit_guard.for_workers``), per-rank logs default to the
attempt's directory on the node, and a failure is also written as JSON
(global rank, local rank, exit code or signal, message) to $HERD_FAILURE_FILE, so the launcher
reports the first failure exactly instead of parsing torchrun's text.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
import traceback
from typing import Any

from ..exit_guard import for_workers
from ..files import write_private
from .protocol import readable_failure
from .worker_exits import watch_in_background

FAILURE_FILE_VAR = "HERD_FAILURE_FILE"
NODE_DIR_VAR = "HERD_NODE_DIR"

# Errors raised before any worker starts, with what usually causes them.
_REMEDIES = {
    "RendezvousTimeoutError": "not every node joined the rendezvous in time: run `herd doctor` "
    "to find the node that cannot reach the rendezvous host",
    "RendezvousConnectionError": "this node cannot reach the rendezvous store: check the "
    "rendezvous address and port are reachable from here (`herd doctor`)",
    "RendezvousClosedError": "the rendezvous was closed by another node (a job ended or failed)",
}


# Seconds a node that is not the rendezvous host waits for the host's store to accept before it
# hands over to torchrun (see wait_for_store); a host slower than this costs its backoff again.
STORE_WAIT_S = 30.0
# Seconds between its tries: a refused connection comes back at once on a LAN.
STORE_POLL_S = 0.02


# Started with only this flag, the wrapper imports torch while the launcher is still probing and
# planning, then reads the job ({"argv": [...], "env": {...}}) as one JSON line on stdin.
PREWARM_FLAG = "--herd-prewarm"


def prewarmed() -> int:
    """Import torch now; run torchrun with the job that arrives on stdin (none: exit 0)."""
    try:
        import torch.distributed.run  # noqa: F401 - the point is to have it imported already
    except ImportError:
        pass  # main() imports again and records the error with the job's failure file
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    job = json.loads(line)
    os.environ.update(job["env"])
    # Workers inherit stdin: give them /dev/null, as a wrapper started for the job would.
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return main(list(job["argv"]))


def main(argv: list[str]) -> int:
    if argv == [PREWARM_FLAG]:
        return prewarmed()
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run
    except ImportError as exc:
        _write_record(
            {
                "kind": "launcher",
                "error": type(exc).__name__,
                "message": f"cannot import torch with {sys.executable}: {exc}",
                "remedy": "install torch in this interpreter on the node, or point [cluster] "
                "python (or the node's python) at one that has it",
            }
        )
        print(f"torchherd: cannot import torch with {sys.executable}: {exc}", file=sys.stderr)
        return 3

    args = parse_args(argv)
    for_workers(os.environ)  # the workers' exit wait (exit_guard), in herd's workers only
    node_dir = os.environ.get(NODE_DIR_VAR)
    if node_dir and not args.log_dir:
        # Each attempt's per-rank files apart: `herd logs --rank` reads them there.
        attempt = os.environ.get("HERD_ATTEMPT", "0")
        args.log_dir = os.path.join(node_dir, f"attempt-{attempt}", "torchrun")
    from .. import progress

    progress.mark("ready", wrapper=True)  # torch imported: torchrun's rendezvous begins
    watch_in_background()  # a worker's bad end told to the agent at once (worker_exits)
    try:
        store = store_to_wait_for(args)
        if store is not None:
            wait_for_store(*store)
        run(args)
    except ChildFailedError as exc:
        _write_record(
            {"kind": "workers", "failures": [_failure(r, f) for r, f in exc.failures.items()]}
        )
        said, _ = readable_failure(exc.get_first_failure()[1].message)
        print(f"torchherd: workers failed: {said}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except SignalException as exc:
        # The agent asked torchrun to stop (herd stop, Ctrl-C, another node failed): a clean
        # stop, not an error worth a traceback.
        print(f"torchherd: torchrun stopped by {signal.Signals(exc.sigval).name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    except Exception as exc:  # any other torchrun error: record it with the remedy we know
        name = type(exc).__name__
        traceback.print_exc()
        _write_record(
            {
                "kind": "launcher",
                "error": name,
                "message": str(exc),
                "remedy": _REMEDIES.get(name, ""),
            }
        )
        return 1
    return 0


def store_to_wait_for(args: Any) -> tuple[str, int] | None:
    """(host, port) of the rendezvous store this node joins as a client, from torchrun's
    parsed arguments; None where this node hosts it (static: node rank 0; c10d: is_host=1)
    or herd cannot tell."""
    conf = str(args.rdzv_conf or "").replace(" ", "").split(",")
    if args.rdzv_backend == "static":
        hosts = args.node_rank == 0
    elif args.rdzv_backend == "c10d" and ("is_host=0" in conf or "is_host=1" in conf):
        hosts = "is_host=1" in conf
    else:
        return None
    host, _, port = str(args.rdzv_endpoint or "").rpartition(":")
    if hosts or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def wait_for_store(host: str, port: int, within: float = STORE_WAIT_S) -> bool:
    """Wait until the rendezvous host's store accepts a connection, trying every
    STORE_POLL_S s, for at most ``within`` s; True once it did.

    torch's store client retries a refused connection after a backoff of up to about a
    second, so a node whose wrapper imported torch before the host's did (most nodes, half
    the time) joined the rendezvous up to a second after the store was up: measured as the
    start's "rendezvous" phase (0.5 s median on 3 nodes). Once this returns, torch's client
    connects at its first try. The store sees a connection that closes at once, which it
    drops. Never an error: torch's own wait and its messages follow as before."""
    deadline = time.monotonic() + within
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            socket.create_connection((host, port), timeout=min(1.0, left)).close()
            return True
        except OSError:
            time.sleep(STORE_POLL_S)


def _failure(global_rank: int, failure: Any) -> dict[str, Any]:
    signal = failure.signal_name() if failure.exitcode < 0 else None
    message, callstack = readable_failure(failure.message)
    return {
        "rank": global_rank,
        "local_rank": failure.local_rank,
        "pid": failure.pid,
        "exitcode": failure.exitcode,
        "signal": signal,
        "message": message,
        "traceback": callstack,
        "timestamp": failure.timestamp or int(time.time()),
        # An error file exists only where the worker recorded its own exception (@record);
        # such a failure is a cause, not a worker killed because another one failed.
        "recorded": bool(failure.error_file) and os.path.isfile(failure.error_file),
    }


def _write_record(record: dict[str, Any]) -> None:
    path = os.environ.get(FAILURE_FILE_VAR)
    if not path:
        return
    write_private(path, json.dumps(record))


def leave(code: int) -> None:
    """Exit at once once the output is out: the attempt is over, and an orderly interpreter
    teardown with torch loaded costs about a second, which every node's stop adds to a
    restart (the next attempt waits for the last node to confirm its end). Nothing is left to
    finish here: the workers have ended, the failure record is written."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    leave(main(sys.argv[1:]))

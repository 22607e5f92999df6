"""Entry point on a node: `python -m torchherd.agent COMMAND`; USAGE lists the commands."""

from __future__ import annotations

import json
import os
import sys

USAGE = """usage: python -m torchherd.agent COMMAND [ARGS]
  probe    print what this node has (python, torch, GPUs, NICs, ports) as JSON; request on stdin
  run      run one job for the launcher: a job request on stdin, JSON-lines events on stdout
  net      the network checks of `herd doctor` and `herd bench net` (TCP, ports, bandwidth)
  stop     end a job on this node: ask its agent, then sweep its tagged processes
  status   whether a job is alive on this node, and how it ended if it did
  logs     a detached job's events on this node (by rank; followed to its end if asked)
  top      the node's load and the job's ranks, for `herd top`
stop, status, logs and top read one JSON request line on stdin."""


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command == "probe":
        from .probe import collect

        raw = sys.stdin.read() if not sys.stdin.isatty() else ""
        request = json.loads(raw) if raw.strip() else {}
        print(json.dumps(collect(request)))
        return 0
    if command == "run":
        from .runner import main as run_main

        code = run_main()
        sys.stdout.flush()
        # A daemon thread still blocks reading stdin; leave without waiting for it.
        os._exit(code)
    if command == "net":
        from .netcheck import main as net_main

        return net_main(argv[1:])
    if command == "top":
        from .control import read_request
        from .node_load import main as top_main

        request = read_request(command)
        return 2 if request is None else top_main(request)
    if command in ("stop", "status", "logs"):
        from .control import main as control_main

        return control_main(command, argv[1:])
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

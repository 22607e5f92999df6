"""Entry point on a node: `python -m torchherd.agent probe|run|net`."""

from __future__ import annotations

import json
import os
import sys


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
    if command in ("stop", "status", "logs", "top"):
        from .control import main as control_main

        return control_main(command, argv[1:])
    print("usage: python -m torchherd.agent probe|run|net", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m torchherd.agent.fanout`: an inner node of a tree starts the relays of its subtree.

Above ``[cluster] tree_above`` nodes the launcher opens ssh connections to a few inner nodes
only (transport/tree.py), and each inner node runs this over one session: it starts, over its
own ssh client, the relay (agent/relay.py) on every node of its subtree, which dials straight
back to the launcher. So the launcher pays a key exchange per inner node, not per node, and
every node still gets a link of its own to the launcher: the inner node carries nothing once
its subtree's relays have connected (they detach from the sessions that started them), and
losing it loses no other node.

stdin: the launcher's token (one line), passed on to each relay as its first line, then one
JSON line:  {"nodes": [{"name": N, "argv": [ssh, ..., host, "--", line]}, ...], "width": W}.
Each relay's line names the launcher as ``@ssh-client``; this node puts the address the
launcher's session came from (SSH_CONNECTION) in its place: the relays dial the launcher where
this node reached it from. A ``-F FILE`` the launcher's ssh used is kept only where FILE is on
this node too (a shared home); otherwise this node's own ssh config and keys apply.

Output, as ``srun --label`` gives a step's (transport/relay.py's StepBatch reads both): each
node's ssh error output on stderr as ``INDEX: line``, and for a node whose ssh ended badly
``herd fanout: error: NAME: task INDEX: Exited with exit code CODE``. At most W ssh clients run
at once. Standard library only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

from .relay import SSH_CLIENT_ADDR

DEFAULT_WIDTH = 32
# Seconds one node's ssh may take to start its relay (its relay detaches once connected).
SSH_LIMIT = 120.0
_print_lock = threading.Lock()


def say(line: str) -> None:
    with _print_lock:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def launcher_address(environ: dict[str, str]) -> str:
    """The address the launcher's ssh session to this node came from."""
    return (environ.get("SSH_CONNECTION") or "").split(" ", 1)[0]


def node_argv(argv: list[str], address: str) -> list[str]:
    """One node's ssh argv, with the launcher's address in its line, and a ``-F FILE`` kept
    only where FILE exists here."""
    out: list[str] = []
    words = iter(argv)
    for word in words:
        if word == "-F":
            path = next(words, "")
            if os.path.isfile(path):
                out += ["-F", path]
            continue
        out.append(word)
    if out and address:
        out[-1] = out[-1].replace(f"={SSH_CLIENT_ADDR}", f"={address}")
    return out


def start_one(index: int, node: dict[str, Any], token: str, address: str) -> None:
    name = str(node["name"])
    try:
        process = subprocess.run(
            node_argv([str(word) for word in node["argv"]], address),
            input=f"{token}\n".encode(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=SSH_LIMIT,
        )
        code, err = process.returncode, process.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired:
        code, err = 255, f"ssh to {name} took more than {SSH_LIMIT:g} s: timed out\n"
    except OSError as exc:
        code, err = 255, f"cannot run ssh: {exc}\n"
    for line in err.splitlines():
        say(f"{index}: {line}")
    if code != 0:
        say(f"herd fanout: error: {name}: task {index}: Exited with exit code {code}")


def main() -> int:
    token = sys.stdin.readline().strip()
    try:
        request = json.loads(sys.stdin.readline())
        nodes = list(request["nodes"])
        width = max(1, int(request.get("width") or DEFAULT_WIDTH))
    except (ValueError, KeyError, TypeError) as exc:
        say(f"herd fanout: a bad request: {exc}")
        return 2
    address = launcher_address(dict(os.environ))
    slots = threading.Semaphore(width)

    def one(index: int, node: dict[str, Any]) -> None:
        with slots:
            start_one(index, node, token, address)

    threads = [
        threading.Thread(target=one, args=(index, node), daemon=True)
        for index, node in enumerate(nodes)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())

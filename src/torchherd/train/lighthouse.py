"""torchft's lighthouse, as herd runs it on a node for a job run as replica groups
(``python -m torchherd.train.lighthouse --min_replicas=1 --bind=ADDR:PORT ...``; the arguments
are the ``torchft_lighthouse`` program's). A module rather than that program: the program sits
in the environment's bin directory, which need not be on the node's PATH, while the job's
python is what herd knows.

torchft's ``lighthouse_main`` parses the process's own command line, skipping only the
interpreter (it expects ``python SCRIPT ARGS``); under ``python -u -m MODULE`` it would read
``-u`` and ``-m`` as its own options. So the module replaces itself (same pid) with
``python THIS_FILE ARGS``, and the file run that way starts the lighthouse.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def main() -> int:
    if importlib.util.find_spec("torchft") is None:
        print(
            "herd: torchft is not installed on this node; pip install 'torchherd[ft]'",
            file=sys.stderr,
        )
        return 2
    if sys.orig_argv[1:2] != [__file__]:
        # Before importing torchft (which imports torch): the new process imports it once.
        os.execv(sys.executable, [sys.executable, __file__, *sys.argv[1:]])
    from torchft._torchft import lighthouse_main

    lighthouse_main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

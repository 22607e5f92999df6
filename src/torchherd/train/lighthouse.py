"""torchft's lighthouse, as herd runs it on a node for a job run as replica groups
(``python -m torchherd.train.lighthouse --min_replicas=1 --bind=[::]:PORT ...``; the arguments
are the ``torchft_lighthouse`` program's). A module rather than that program: the program sits
in the environment's bin directory, which need not be on the node's PATH, while the job's
python is what herd knows."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from torchft._torchft import lighthouse_main
    except ImportError:
        print(
            "herd: torchft is not installed on this node; pip install 'torchherd[ft]'",
            file=sys.stderr,
        )
        return 2
    sys.argv[0] = "torchft_lighthouse"
    lighthouse_main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Test job (no torch): rank 0 dies (exit code 3) while its sibling on the same node, rank 1,
takes 6 s to answer SIGTERM, as a rank stuck in a call does; every other rank waits, as in a
collective that can never complete. torchrun on rank 0's node ends only once rank 1 does.

Before it dies, rank 0 leaves a progress bar's line unfinished on its stderr. Rank 1 prints
"SIBLING asked to stop" when SIGTERM comes and "SIBLING leaving" as it ends;
every rank prints "UP rank=R" once it is ready (rank 1: its SIGTERM handler set), and rank 0
fails only once every rank is up (the file "up-R" of each in --run-dir).
"""

import os
import signal
import sys
import time
from pathlib import Path

from torchherd.progress import beat

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
here = Path(sys.argv[sys.argv.index("--run-dir") + 1])


def slow_to_stop(signum, frame):  # type: ignore[no-untyped-def]
    print("SIBLING asked to stop", flush=True)
    time.sleep(6)
    print("SIBLING leaving", flush=True)
    os._exit(0)


if rank == 1:
    signal.signal(signal.SIGTERM, slow_to_stop)
beat(0)
(here / f"up-{rank}").write_text(str(os.getpid()))
print(f"UP rank={rank}", flush=True)
if rank == 0:
    while not all((here / f"up-{r}").exists() for r in range(world)):
        time.sleep(0.1)
    print("rank 0 failing on purpose", file=sys.stderr, flush=True)
    # A progress bar's line, unfinished (as tqdm leaves it between updates), copied by torchrun
    # to its own stderr before the rank dies: nothing herd hears of the death may hang on it.
    print("\r 50%|#####     | 5/10", end="", file=sys.stderr, flush=True)
    time.sleep(0.5)
    os._exit(3)
while True:
    time.sleep(1)
